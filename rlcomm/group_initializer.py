"""Group initializers: turn one mode's rank lists into torch process groups.

Every rank calls ``init_dist_group`` for every group of a mode, in the same order, whether or not
it is a member (torch requires it); the rank registers only the group it belongs to. The set is
open: ``register_initializer("MY_MODE", MyInitializer)`` adds a mode without editing rlcomm.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import torch.distributed as dist
from torch.distributed import ProcessGroup

from rlcomm.plan.layout import RankLists, grid_groups, validate_rank_lists

from .errors import LayoutError
from .modes import CommMode, Mode, ParallelMode, mode_name, register_mode_name
from .utils import format_ranks


class GroupRegistration(NamedTuple):
    """What ``CommContext._register_group`` takes (the original CommContext's argument order, see
    :mod:`rlcomm.context`, plus the declared order of the ranks, whose first entry is e.g. the
    weight-transfer sender)."""

    local_rank: int | None
    world_size: int
    process_group: ProcessGroup | None
    ranks_in_group: list[int]
    mode: str
    declared_ranks: list[int]


def group_description(mode: str, ranks: Sequence[int]) -> str:
    """``WEIGHT_TRANSFER[0,2]``: the name torch prints in its logs and timeout messages."""
    return f"{mode}{format_ranks(list(ranks))}"


class GroupInitializer:
    """Creates one group per rank list of ``ranks`` (a flat list is one group) for the mode
    ``mode=`` names (default: the class's ``mode``)."""

    mode: ClassVar[str] = ""

    def __init__(
        self,
        rank: int,
        world_size: int,
        ranks: Sequence[int] | Sequence[Sequence[int]],
        *,
        mode: Mode | None = None,
        timeout: datetime.timedelta | None = None,
        **options: Any,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.ranks = ranks
        self.mode_name = mode_name(mode) if mode is not None else self.mode
        self.timeout = timeout
        self.options = options

    def rank_lists(self) -> RankLists:
        """The groups to create, validated; subclasses may derive them (see size-based ones)."""
        return validate_rank_lists(self.mode_name, self.ranks, self.world_size)

    def init_dist_group(self, backend: str | None, use_cpu: bool = False) -> GroupRegistration:
        """Validate this mode's rank lists, then create its groups (see :meth:`create`)."""
        return self.create(self.rank_lists(), "gloo" if use_cpu else backend)

    def create(self, rank_lists: RankLists, backend: str | None) -> GroupRegistration:
        """One ``new_group`` per list, in order, on every rank; returns this rank's group (or a
        registration whose ``local_rank`` is None when it is in none). ``rank_lists`` must be
        valid already: ``init_dist_group`` validates, a planned layout was validated by the
        planner."""
        mine = GroupRegistration(None, 0, None, [], self.mode_name, [])
        for declared in rank_lists:
            member = self.rank in declared
            # torch keeps a description only for groups this rank is in; skip building the rest.
            group = dist.new_group(
                declared,  # a tuple is fine: torch sorts it into a list itself
                timeout=self.timeout,
                backend=backend,
                group_desc=group_description(self.mode_name, declared) if member else None,
            )
            if member:
                ranks = sorted(declared)
                # torch orders a group by sorted global rank; ask it rather than assume.
                mine = GroupRegistration(
                    dist.get_rank(group), len(ranks), group, ranks, self.mode_name, list(declared)
                )
        return mine


class SizeGroupInitializer(GroupInitializer):
    """DATA/TENSOR/SEQUENCE_PARALLEL: explicit rank lists, or a flat list of ranks plus
    ``group_size`` for the usual Megatron grid (TP contiguous, SP inside TP blocks, DP strided;
    SEQUENCE_PARALLEL also needs ``tensor_parallel_size``)."""

    def rank_lists(self) -> RankLists:
        size = self.options.get("group_size")
        if size is None:
            return super().rank_lists()
        flat = validate_rank_lists(self.mode_name, [self.ranks], self.world_size)[0]
        inner = self.options.get("tensor_parallel_size")
        if self.mode_name == ParallelMode.SEQUENCE_PARALLEL and inner is None:
            raise LayoutError(
                "SEQUENCE_PARALLEL: group_size needs tensor_parallel_size= too (SP groups are "
                "strided by the TP size inside blocks of group_size x tensor_parallel_size)"
            )
        return grid_groups(flat, self.mode_name, int(size), int(inner or 1))


# The original CommContext builds these three by name, without a mode
# (``TrainDPGroupInitializer(rank, world_size, ranks)``): each is the plain initializer with its
# mode fixed. ``init_group`` and ``init_groups`` pass ``mode=`` to the class registered below.
class TrainDPGroupInitializer(GroupInitializer):
    """Trainer data parallelism (the DDP group)."""

    mode = ParallelMode.TRAIN_DATA_PARALLEL.value


class IntraNodeGroupInitializer(GroupInitializer):
    mode = CommMode.INTRA_NODE.value


class WeightTransferGroupInitializer(GroupInitializer):
    """Trainer -> rollout workers; list each group with its trainer first."""

    mode = ParallelMode.WEIGHT_TRANSFER.value


# mode -> the initializer built for it; the parametrised two cover every shipped mode.
_INITIALIZERS: dict[str, type[GroupInitializer]] = {
    **dict.fromkeys(
        (
            ParallelMode.TRAIN_DATA_PARALLEL.value,
            CommMode.INTRA_NODE.value,
            CommMode.INTER_NODE.value,
            ParallelMode.WEIGHT_TRANSFER.value,
            ParallelMode.REPLAY.value,
        ),
        GroupInitializer,
    ),
    **dict.fromkeys(
        (
            ParallelMode.TENSOR_PARALLEL.value,
            ParallelMode.SEQUENCE_PARALLEL.value,
            ParallelMode.DATA_PARALLEL.value,
        ),
        SizeGroupInitializer,
    ),
}


def register_initializer(mode: Mode, initializer: type[GroupInitializer]) -> None:
    """Make ``init_group(ranks, mode)`` use ``initializer`` for ``mode`` (a new name is fine)."""
    name = mode_name(mode)
    if name == CommMode.GLOBAL:
        raise LayoutError("GLOBAL is created by init_distributed_env and cannot be re-registered")
    register_mode_name(name)
    _INITIALIZERS[name] = initializer


def get_initializer(mode: Mode | None) -> type[GroupInitializer]:
    name = mode_name(mode) if mode is not None else "None"
    try:
        return _INITIALIZERS[name]
    except KeyError:
        raise NotImplementedError(
            f"Parallel mode {name} is not supported for group initialization; known: "
            f"{', '.join(sorted(_INITIALIZERS))} (add one with rlcomm.register_initializer)"
        ) from None
