"""Epochs: a group's successive memberships, each a process group of its own.

Each membership is an *epoch*: the planned group is epoch 0; every later one is a new
``ProcessGroupGloo`` among the leader and the live members, built over a store prefix of its
own (``PrefixStore``), as torchft reconfigures its groups, with public torch APIs only, and
validated like a planned group (:func:`build_epoch_group`). The leader keeps the records of
every change in the store (:class:`EpochRecords`): a join request (:func:`request_join`), the
proposed members of the next epoch, each member's acknowledgement (:func:`acknowledge`), the
members once settled. The keys are rlcomm/elastic/keys.py's.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import distributed as dist

from rlcomm.elastic.keys import RUNNING, Keys, grown, leave_request, leave_requests, let_go
from rlcomm.errors import MembershipError
from rlcomm.net.gloo_words import describe_loss


def mark_running(store: dist.Store) -> None:
    """Rank 0, once every planned group exists: a process that starts as a rank of this job
    from now on replaces a lost one and joins (:func:`is_running`)."""
    store.set(RUNNING, "1")


def is_running(store: dist.Store) -> bool:
    return bool(store.check([RUNNING]))


# What a join of a rank the plan did not have is recorded as (its users' records, result.json).
BEYOND_PLAN = "beyond the plan"


@dataclass(frozen=True)
class Join:
    """A process asking to join ``leader``'s group as ``rank``."""

    rank: int
    host: str
    pid: int
    beyond_plan: bool = False  # a rank the plan did not have (the job grows by it)


def build_epoch_group(
    store: dist.Store, leader: int, epoch: int, members: list[int], rank: int,
    timeout: datetime.timedelta, space: str = "",
) -> dist.ProcessGroup:
    """This rank's group of ``epoch`` (``members``, leader first, in group-rank order), over the
    epoch's own store prefix; validated: every member must hold the same epoch and list.
    ``space``: another series of groups the same leader leads (its own epochs, prefixes)."""
    prefix = dist.PrefixStore(Keys(leader, space).group(epoch), store)
    position = members.index(rank)
    digest = _digest(members)
    seen = torch.zeros(len(members), 3, dtype=torch.int64)  # each member fills its own row
    seen[position] = torch.tensor([epoch, rank, digest])
    try:
        group = cast(dist.ProcessGroup,
                     dist.ProcessGroupGloo(prefix, position, len(members), timeout))
        group.allreduce([seen]).wait()
    except RuntimeError as err:  # DistStoreError too: a member missing, or of another epoch
        raise MembershipError(
            f"rank {rank}: epoch {epoch} of rank {leader}'s group should be ranks {members}; "
            f"it did not form within {timeout.total_seconds():g} s: a member is missing or "
            f"holds another epoch or member list ({describe_loss(err)})") from err
    found = [(int(e), int(r)) for e, r, _ in seen.tolist()]
    others = [int(r) for e, r, d in seen.tolist() if (e, d) != (epoch, digest)]
    if found != [(epoch, r) for r in members] or others:
        disagree = f"; rank(s) {', '.join(map(str, others))} hold another member list" \
            if others else ""
        raise MembershipError(
            f"rank {rank}: epoch {epoch} of rank {leader}'s group should be ranks {members}; "
            f"its members report (epoch, rank) {found}{disagree}"
        )
    return group


def _digest(members: list[int]) -> int:
    return zlib.crc32(json.dumps(members).encode())  # the same in every process; fits int64


class EpochRecords:
    """The leader's records: who is in its group, and the store records of every change.
    ``space``: a series of groups of its own that the same leader leads (keys and prefixes
    under ``elastic/<leader>/<space>``); ``members``: the first epoch's, if not the planned."""

    def __init__(self, store: dist.Store, leader: int, planned: list[int], epoch: int = 0,
                 space: str = "", members: list[int] | None = None) -> None:
        self.store, self.leader, self.space = store, leader, space
        self.keys = Keys(leader, space)
        self.planned = list(planned)  # the layout's group: who may join
        self.members = [r for r in (planned if members is None else members) if r != leader]
        self.epoch = epoch
        # Every join request of this job's store counts: one may come before this exists.
        self._joins_seen = 0
        self._leaves_seen = 0  # every leave request of the job counts, as the joins
        first = json.dumps([leader, *self.members])
        store.set(self.keys.epoch(epoch), first)
        # Fixed as it starts: a member of a lost predecessor that reads it is told it is out
        # (acknowledge: None) and asks to join.
        store.set(self.keys.final(epoch), first)
        store.set(self.keys.latest(), str(epoch))

    def pending_joins(self) -> list[Join]:
        """Join requests that arrived since the last call (one store round trip when none)."""
        count = int(self.store.add(self.keys.joins(), 0))
        found = []
        for n in range(self._joins_seen, count):
            record = json.loads(self.store.get(self.keys.join(n)))
            beyond = bool(record.get("beyond_plan"))
            if beyond and record["rank"] not in self.planned:  # it asked this leader: it may
                self.planned.append(int(record["rank"]))
            if record["rank"] in self.planned and record["rank"] != self.leader:
                found.append(Join(int(record["rank"]), str(record["host"]), int(record["pid"]),
                                  beyond))
        self._joins_seen = count
        return found

    def pending_leaves(self) -> dict[int, str]:
        """Leave requests (:func:`ask_to_leave`) for this group's members that arrived since
        the last call: rank -> reason (one store round trip when none)."""
        count = int(self.store.add(leave_requests(), 0))
        found: dict[int, str] = {}
        for n in range(self._leaves_seen, count):
            record = json.loads(self.store.get(leave_request(n)))
            if record["rank"] in self.members:
                found[int(record["rank"])] = str(record["reason"])
        self._leaves_seen = count
        return found

    def let_go(self, rank: int) -> None:
        """``rank`` leaves at its request: the epoch proposed next is the first without it."""
        self.store.set(let_go(rank), str(self.epoch + 1))

    def announce(self, members: list[int], joins: list[Join]) -> int:
        """Proposes the next epoch with ``members`` (leader excluded): its record goes in the
        store, and each joiner is told it; returns the epoch. The members acknowledge it
        (:func:`acknowledge`) and :meth:`confirm` settles who is in."""
        self.epoch += 1
        self.members = list(members)
        self.store.set(self.keys.epoch(self.epoch), json.dumps([self.leader, *self.members]))
        self.store.set(self.keys.latest(), str(self.epoch))
        for join in joins:
            # A new process for a rank once let go: not this one, which must not end so.
            self.store.delete_key(let_go(join.rank))
            self.store.set(self.keys.admit(join.rank, join.pid), str(self.epoch))
        return self.epoch

    def confirm(self, timeout_s: float, poll_s: float = 0.005,
                gone: Callable[[list[int]], list[int]] | None = None,
                along: Callable[[list[int]], list[int]] | None = None) -> list[int]:
        """Waits up to ``timeout_s`` for every proposed member's acknowledgement, then fixes the
        epoch's members to those that gave it (``final/<e>``); returns the ones that did not
        (gone since, or cut off: the group would wait for them in vain). ``gone(waiting)``:
        those of the members still waited for known to be gone (no need to wait longer).
        ``along(missing)``: members that leave with the missing ones although they answered
        (returned too; an acknowledging one then reads that it is out)."""
        keys = {r: self.keys.ack(self.epoch, r) for r in self.members}
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = [r for r, k in keys.items() if not self.store.check([k])]
            if not waiting or time.monotonic() > deadline:
                break
            if gone is not None and set(gone(waiting)) == set(waiting):
                break
            time.sleep(poll_s)
        missing = [r for r, k in keys.items() if not self.store.check([k])]
        if along is not None and missing:
            missing += [r for r in along(missing) if r in self.members and r not in missing]
        self.members = [r for r in self.members if r not in missing]
        self.store.set(self.keys.final(self.epoch), json.dumps([self.leader, *self.members]))
        return missing

    def group(self, rank: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
        return build_epoch_group(self.store, self.leader, self.epoch,
                                 [self.leader, *self.members], rank, timeout, self.space)


def acknowledge(store: dist.Store, leader: int, epoch: int, rank: int,
                timeout: datetime.timedelta, space: str = "") -> list[int] | None:
    """A member's answer to a proposed epoch: it acknowledges and waits for the leader to fix
    the members; returns them (leader first), or None if it was left out (too late)."""
    keys = Keys(leader, space)
    store.set(keys.ack(epoch, rank), "1")
    final = keys.final(epoch)
    store.wait([final], timeout)
    members = [int(r) for r in json.loads(store.get(final))]
    return members if rank in members else None


def request_join(store: dist.Store, leader: int, rank: int, space: str = "",
                 beyond_plan: bool = False) -> Join:
    """A new process asks ``leader`` to admit it as ``rank`` at its next update boundary;
    ``beyond_plan``: a rank the plan did not have, which the leader then admits too."""
    join = Join(rank, socket.gethostname(), os.getpid(), beyond_plan)
    keys = Keys(leader, space)
    n = int(store.add(keys.joins(), 1)) - 1
    store.set(keys.join(n), json.dumps(join.__dict__))
    return join


def new_rank(store: dist.Store, world_size: int) -> int:
    """A rank number beyond the plan of ``world_size`` ranks, never given before in the job."""
    return new_ranks(store, world_size, 1)[0]


def new_ranks(store: dist.Store, world_size: int, count: int) -> list[int]:
    """``count`` consecutive rank numbers beyond the plan (a replica group's), never given
    before in the job."""
    end = world_size + int(store.add(grown(), count))
    return list(range(end - count, end))


def ask_to_leave(store: dist.Store, rank: int, reason: str) -> None:
    """Asks ``rank``'s leader, whichever it is, to let it go at its next update boundary (the
    rank itself, or a process that reaches the job's store)."""
    n = int(store.add(leave_requests(), 1)) - 1
    store.set(leave_request(n), json.dumps({"rank": rank, "reason": reason}))


def let_go_epoch(store: dist.Store, rank: int) -> int | None:
    """The epoch from which ``rank``'s leader let it go at its request, or None."""
    key = let_go(rank)
    return int(store.get(key)) if store.check([key]) else None


def was_let_go(store: dist.Store, rank: int, epoch: int) -> bool:
    """Whether ``rank``'s leader let it go at its request by ``epoch``."""
    since = let_go_epoch(store, rank)
    return since is not None and since <= epoch


def await_admission(store: dist.Store, leader: int, join: Join, timeout_s: float,
                    poll_s: float = 0.05, space: str = "") -> tuple[int, list[int]]:
    """Waits until ``leader`` admits ``join``; returns its epoch and the proposed members
    (leader first), which it then :func:`acknowledge` s."""
    key = Keys(leader, space).admit(join.rank, join.pid)
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise MembershipError(
                f"rank {join.rank}: rank {leader} did not admit it within {timeout_s:g} s"
            )
        time.sleep(poll_s)
    epoch = int(store.get(key))
    return epoch, epoch_members(store, leader, epoch, space)


def epoch_members(store: dist.Store, leader: int, epoch: int, space: str = "") -> list[int]:
    return [int(r) for r in json.loads(store.get(Keys(leader, space).epoch(epoch)))]


def close_membership(store: dist.Store, leader: int, members: list[int], space: str) -> None:
    """The run ended with ``members`` (leader first) in ``leader``'s ``space``."""
    store.set(Keys(leader, space).closed(), json.dumps(members))


def closing_members(store: dist.Store, leader: int, space: str) -> list[int] | None:
    """The members :func:`close_membership` left, or None before it."""
    key = Keys(leader, space).closed()
    return [int(r) for r in json.loads(store.get(key))] if store.check([key]) else None


def latest_epoch(store: dist.Store, leader: int, space: str = "") -> int:
    return int(store.get(Keys(leader, space).latest()))
