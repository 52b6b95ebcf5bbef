"""The table of a context's groups: one group per mode for this rank, with its size, its ranks
and this rank's place in it, looked up by mode (``CommContext``'s, from which it is split)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import distributed as dist
from torch.distributed import ProcessGroup

from .elastic.groups import EpochGroups
from .errors import GroupRegistrationError, ModeNotRegisteredError
from .group_initializer import group_description
from .modes import CommMode, Mode, mode_name


@dataclass(frozen=True)
class GroupInfo:
    """One registered group as plain data (what ``describe`` returns per mode)."""

    local_rank: int
    world_size: int
    ranks: list[int]
    declared_ranks: list[int]


class GroupRegistry:
    """This rank's groups by mode (``mode_name``): the process group, this rank's local rank,
    the group's size, its ranks in group-rank order and in the order declared."""

    def __init__(self) -> None:
        self._local_ranks: dict[str, int] = {}
        self._global_ranks: dict[str, int] = {}
        self._world_sizes: dict[str, int] = {}
        self._ranks_in_group: dict[str, list[int]] = {}
        self._declared_ranks: dict[str, list[int]] = {}
        self._groups: dict[str, ProcessGroup] = {}
        self.epochs = EpochGroups()  # the modes whose group is a membership epoch's

    def _register_group(
        self,
        local_rank: int | None,
        world_size: int,
        process_group: ProcessGroup | None,
        ranks_in_group: list[int],
        mode: Mode,
        declared_ranks: list[int] | None = None,
    ) -> None:
        """Record this rank's group of ``mode``; a second group of one mode is an error."""
        if local_rank is None or process_group is None:
            return
        key = mode_name(mode)
        if key in self._groups:
            raise GroupRegistrationError(
                f"rank {self._global_ranks.get(CommMode.GLOBAL, '?')} is already in "
                f"{group_description(key, self._declared_ranks[key])} and cannot also join "
                f"{group_description(key, declared_ranks or ranks_in_group)}: "
                f"a rank belongs to at most one group per mode"
            )
        self._local_ranks[key] = local_rank
        self._world_sizes[key] = world_size
        self._groups[key] = process_group
        self._ranks_in_group[key] = list(ranks_in_group)
        self._declared_ranks[key] = list(declared_ranks or ranks_in_group)

    def _lookup(self, table: dict[str, Any], comm_mode: Mode) -> Any:
        key = mode_name(comm_mode)
        if key not in table:
            rank = self._global_ranks.get(CommMode.GLOBAL)
            who = f"rank {rank}" if rank is not None else "this process (not initialized)"
            have = ", ".join(self._groups) or "none"
            raise ModeNotRegisteredError(
                f"{who} is not a member of any {key} group; its modes: {have}"
            )
        return table[key]

    def get_group(self, comm_mode: Mode) -> ProcessGroup:
        """The process group of ``comm_mode`` this rank belongs to."""
        return self._lookup(self._groups, comm_mode)

    def get_device(self, comm_mode: Mode) -> torch.device:
        """Where tensors for this mode's group live: the current GPU for nccl, else the CPU."""
        if self.epochs.holds(comm_mode):  # a membership epoch's group: gloo
            return torch.device("cpu")
        if dist.get_backend(self.get_group(comm_mode)) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def get_world_size(self, comm_mode: Mode) -> int:
        """Size of this rank's group of ``comm_mode``."""
        return self._lookup(self._world_sizes, comm_mode)

    def get_global_rank(self) -> int:
        """This process's rank in the global group."""
        return self._lookup(self._global_ranks, CommMode.GLOBAL)

    def get_local_rank(self, comm_mode: Mode) -> int:
        """This rank's position in its ``comm_mode`` group (torch's: sorted by global rank)."""
        return self._lookup(self._local_ranks, comm_mode)

    def get_ranks_in_group(self, comm_mode: Mode) -> list[int]:
        """Global ranks of this rank's ``comm_mode`` group, in group-rank order."""
        return list(self._lookup(self._ranks_in_group, comm_mode))

    def replace_group(self, mode: Mode, group: ProcessGroup,
                      ranks: list[int]) -> ProcessGroup | None:
        """Make ``group`` (``ranks``: its members in group-rank order) this rank's group of
        ``mode`` in place of the one before, which is returned (None: none); a membership
        epoch's group (rlcomm.elastic: :attr:`epochs` registers them)."""
        key = mode_name(mode)
        before = self._groups.get(key)
        self._groups[key] = group
        self._local_ranks[key] = ranks.index(self.get_global_rank())
        self._world_sizes[key] = len(ranks)
        self._ranks_in_group[key] = list(ranks)
        self._declared_ranks[key] = list(ranks)
        return before

    def describe(self) -> dict[str, GroupInfo]:
        """This rank's registry as data: mode -> local rank, group size, ranks."""
        return {
            mode: GroupInfo(
                self._local_ranks[mode],
                self._world_sizes[mode],
                list(self._ranks_in_group[mode]),
                list(self._declared_ranks[mode]),
            )
            for mode in self._groups
        }

    def get_declared_ranks(self, comm_mode: Mode) -> list[int]:
        """The group's ranks in the order the layout listed them (the first is its leader,
        e.g. the trainer of a WEIGHT_TRANSFER group)."""
        return list(self._lookup(self._declared_ranks, comm_mode))

