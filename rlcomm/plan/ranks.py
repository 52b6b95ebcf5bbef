"""Rank lists as a user writes them, checked: groups of one mode, and the ranks of each role.

A role (``layout.trainers``, ``layout.rollouts``, ``layout.replay``) takes a list of ranks, a count or ranges
(``"0-3,8,10-11"``); see :func:`resolve_roles` for how they combine. Everything is checked on
the numbers a user wrote, before a rank list is built, so a typo such as ``"0-99999999"`` costs
nothing and every error is one line that names the field and the value.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import cast

from rlcomm.errors import LayoutError
from rlcomm.plan.spec import RankSelection
from rlcomm.utils import format_ranks

RankLists = tuple[tuple[int, ...], ...]

TRAINERS = "layout.trainers"
ROLLOUTS = "layout.rollouts"
REPLAY = "layout.replay"
_FORMS = 'a list of ranks [0,1], a count 2 or ranges "0-3,8"'
_ITEM = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")


def validate_rank_lists(
    mode: str, lists: object, world_size: int, where: str | None = None
) -> RankLists:
    """Check one mode's rank lists: ints in range, no duplicates, disjoint, none empty."""
    where = where or mode
    if isinstance(lists, Sequence) and lists and is_int(lists[0]):
        lists = [lists]  # a single flat list is one group
    if not isinstance(lists, Sequence) or isinstance(lists, str) or not lists:
        raise LayoutError(f"{where}: expected a non-empty list of rank lists, got {lists!r}")
    owner: dict[int, int] = {}
    result: list[tuple[int, ...]] = []
    for index, ranks in enumerate(lists):
        group = _rank_tuple(f"{where}[{index}]", ranks)
        if not group:
            raise LayoutError(f"{where}[{index}]: empty group")
        for rank in group:
            if rank < 0 or rank >= world_size:
                raise LayoutError(
                    f"{where}: rank {rank} in group {format_ranks(group)} is out of range "
                    f"for world_size {world_size}"
                )
            if rank in owner:
                other = result[owner[rank]] if owner[rank] < len(result) else group
                what = "twice in group" if owner[rank] == index else "in two groups of one mode:"
                raise LayoutError(
                    f"{where}: rank {rank} appears {what} {format_ranks(other)}"
                    + ("" if owner[rank] == index else f" and {format_ranks(group)}")
                )
            owner[rank] = index
        result.append(group)
    return tuple(result)


def parse_ranges(where: str, text: str, world_size: int) -> tuple[int, ...]:
    """``"0-3,8,10-11"`` -> ``(0, 1, 2, 3, 8, 10, 11)``, in the order written.

    Each comma-separated item is a rank ``N`` or an inclusive range ``A-B`` (``A <= B``); every
    rank must be in ``0..world_size-1`` and appear once.
    """
    spans: list[tuple[int, int, str]] = []
    for item in text.split(","):
        match = _ITEM.fullmatch(item)
        if match is None:
            raise LayoutError(
                f"{where}: {item.strip()!r}{_within(item, text)} is not a rank (8) or a range "
                "(0-3); write e.g. \"0-3,8,10-11\""
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise LayoutError(
                f"{where}: range {item.strip()!r}{_within(item, text)} runs backwards; "
                f"write {last}-{first}"
            )
        if last >= world_size:
            raise LayoutError(
                f"{where}: rank {last} in {text!r} is out of range for world_size {world_size}"
            )
        spans.append((first, last, item))
    ordered = sorted(spans)
    for (_, previous_last, _), (first, _, _) in pairwise(ordered):
        if first <= previous_last:
            raise LayoutError(f"{where}: rank {first} appears twice in {text!r}")
    return tuple(rank for first, last, _ in spans for rank in range(first, last + 1))


def resolve_roles(
    trainers: RankSelection | None, rollouts: RankSelection | None, world_size: int,
    replay: RankSelection | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The trainer, rollout and replay ranks a layout declares, checked.

    - A list keeps its order (a WEIGHT_TRANSFER group pairs the i-th trainer with the i-th share
      of the rollouts); ranges keep the order written.
    - A count N takes the N lowest ranks that the other roles do not name as a list or ranges;
      when several are counts, the trainers come first, then the replay ranks.
    - ``rollouts`` not given (None): every rank that is neither a trainer nor a replay rank, in
      rank order; if none is left the layout is colocated. ``rollouts=[]``: colocated.
    - ``replay`` None or []: no replay ranks (an off-policy loop keeps a replay per trainer).
    - ``trainers`` is required; every rank needs a role; no rank has two.
    """
    train = None if trainers is None else _explicit(TRAINERS, trainers, world_size)
    if trainers is None or train == ():
        raise LayoutError(
            f"{TRAINERS}: missing or empty; list the ranks that train, e.g. [0], or give a "
            'count (1) or ranges ("0-3")'
        )
    roll = None if rollouts is None else _explicit(ROLLOUTS, rollouts, world_size)
    rep = () if replay is None else _explicit(REPLAY, replay, world_size)
    if train is None:
        train = _lowest(TRAINERS, trainers, world_size, (*(roll or ()), *(rep or ())),
                        "rollouts or replay" if rep else "rollouts")
    if rep is None:
        rep = _lowest(REPLAY, replay, world_size, (*train, *(roll or ())), "trainers or rollouts")
    _check_apart(REPLAY, rep, train, "trainers")
    if roll is None and rollouts is not None:
        roll = _lowest(ROLLOUTS, rollouts, world_size, (*train, *rep),
                       "trainers or replay" if rep else "trainers")
    if roll is None:  # not given: the rest of the ranks
        taken = set(train).union(rep)
        roll = tuple(rank for rank in range(world_size) if rank not in taken)
    _check_apart(ROLLOUTS, roll, train, "trainers")
    _check_apart(REPLAY, rep, roll, "rollouts")
    if len(train) + len(roll) + len(rep) != world_size:
        assigned = set(train).union(roll, rep)
        missing = [rank for rank in range(world_size) if rank not in assigned]
        raise LayoutError(
            f"layout: ranks {format_ranks(missing)} are neither trainers"
            f"{', rollouts nor replay' if rep else ' nor rollouts'} (world_size {world_size})"
        )
    if roll and len(roll) < len(train):
        raise LayoutError(
            f"{ROLLOUTS}: {len(roll)} rollout ranks cannot serve {len(train)} trainers;"
            " give each trainer at least one, or none for colocated training"
        )
    return train, roll, rep


def _check_apart(where: str, ranks: Sequence[int], others: Sequence[int], role: str) -> None:
    both = sorted(set(ranks).intersection(others))
    if both:
        raise LayoutError(
            f"{where}: ranks {format_ranks(both)} are also {role}; roles must not overlap"
        )


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _explicit(where: str, value: object, world_size: int) -> tuple[int, ...] | None:
    """The ranks a list or ranges name, checked; None for a count."""
    if is_int(value):
        return None
    if isinstance(value, str):  # ranges; blank names no ranks, as [] does
        return parse_ranges(where, value, world_size) if value.strip() else ()
    if isinstance(value, Iterable) and not isinstance(value, (bytes, Mapping)):
        ranks = list(value)
        return validate_rank_lists(where, [ranks], world_size)[0] if ranks else ()
    raise LayoutError(f"{where}: expected {_FORMS}, got {value!r}")


def _lowest(
    where: str, count: object, world_size: int, taken: Sequence[int], other: str
) -> tuple[int, ...]:
    """The ``count`` lowest ranks not in ``taken``."""
    n = cast(int, count)  # the caller found it is an int
    if n < 1:
        hint = {ROLLOUTS: "; [] means no rollout ranks (colocated)",
                REPLAY: "; [] means no replay ranks"}.get(where, "")
        raise LayoutError(f"{where}: a count must be at least 1, got {n}{hint}")
    if n > world_size:
        raise LayoutError(f"{where}: count {n} is more than world_size {world_size}")
    if not taken:
        return tuple(range(n))
    free = world_size - len(taken)
    if n > free:
        raise LayoutError(
            f"{where}: count {n} but only {free} ranks are not {other} (world_size {world_size})"
        )
    busy = set(taken)
    chosen: list[int] = []
    for rank in range(world_size):
        if rank not in busy:
            chosen.append(rank)
            if len(chosen) == n:
                break
    return tuple(chosen)


def _within(item: str, text: str) -> str:
    return "" if item.strip() == text.strip() else f" in {text!r}"


def _rank_tuple(where: str, ranks: object) -> tuple[int, ...]:
    if not isinstance(ranks, Iterable) or isinstance(ranks, (str, bytes)):
        raise LayoutError(f"{where}: expected a list of integer ranks, got {ranks!r}")
    group = tuple(ranks)
    for rank in group:
        if not is_int(rank):
            raise LayoutError(f"{where}: rank {rank!r} is not an integer (in {list(group)!r})")
    return group
