"""Processes that join a job already running (``CommContext``'s side of it, split from the rest):
a replacement for a lost rank has the job's store but no default group, since the world was
formed without it; its groups are membership epochs (rlcomm.elastic). A block of such processes
(a rebuilt replica group of sharded trainers) may form a world of its own among them."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from torch import distributed as dist

from rlcomm.errors import RlcommError
from rlcomm.modes import CommMode
from rlcomm.plan.layout import GRID_MODES

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from rlcomm.modes import Mode
    from rlcomm.plan.layout import LayoutPlan


class _Context(Protocol):
    """What :class:`RunningJob` uses of the context it is mixed into."""

    _store: dist.Store | None
    _backend: str
    _timeout: datetime.timedelta | None
    _plan: LayoutPlan | None
    _global_ranks: dict[str, int]
    _world_sizes: dict[str, int]
    _world_ranks: dict[int, int]

    @property
    def store(self) -> dist.Store: ...

    @property
    def timeout(self) -> datetime.timedelta: ...

    @property
    def joined_running_job(self: _Context) -> bool: ...

    def is_initialized(self) -> bool: ...

    def get_global_rank(self) -> int: ...

    def world_ranks(self: _Context, ranks: Sequence[int]) -> list[int]: ...

    def _register_group(self, local_rank: int | None, world_size: int,
                        process_group: ProcessGroup | None, ranks_in_group: list[int],
                        mode: Mode, declared_ranks: list[int] | None = None) -> None: ...


class RunningJob:
    """What a context does to join a running job (mixed into ``CommContext``, whose state it
    uses: the store, the timeout, the group tables)."""

    _store: dist.Store | None
    _timeout: datetime.timedelta | None
    _plan: LayoutPlan | None

    def __init__(self) -> None:
        # A sub-world's (form_subworld): global rank -> rank in this process's default group.
        self._world_ranks: dict[int, int] = {}

    def form_subworld(self: _Context, plan: LayoutPlan, ranks: Sequence[int], prefix: str) -> None:
        """A process that joined a running job (:meth:`join_running_job`) with the other
        ``ranks`` (a rebuilt replica group of sharded trainers): a default group of their own,
        over the store under ``prefix`` (fresh for each rebuild), and the plan's grid groups
        inside ``ranks``, so that :meth:`device_mesh` works for them. Calls keep taking global
        ranks; :meth:`world_ranks` maps them onto this default group's."""
        if not self.joined_running_job:
            raise RlcommError("form_subworld: for a process that joined a running job")
        members, me = list(ranks), self.get_global_rank()
        dist.init_process_group("gloo", store=dist.PrefixStore(prefix, self.store),
                                rank=members.index(me), world_size=len(members),
                                timeout=self.timeout)
        self._world_ranks = {rank: i for i, rank in enumerate(members)}
        for spec in plan.groups:  # the same order in every process of the sub-world
            if spec.mode not in GRID_MODES:
                continue
            for group in (g for g in spec.rank_lists if set(g) <= set(members)):
                created = dist.new_group(self.world_ranks(group))
                if me in group:
                    self._register_group(list(group).index(me), len(group), created,
                                         list(group), spec.mode)
        self._plan = plan

    def world_ranks(self: _Context, ranks: Sequence[int]) -> list[int]:
        """Global ranks as this process's default group numbers them (themselves, but in a
        sub-world: :meth:`form_subworld`)."""
        return [self._world_ranks.get(rank, rank) for rank in ranks]

    def join_running_job(self: _Context, store: dist.Store, rank: int, world_size: int,
                         timeout: int) -> None:
        """A process that joins a running job as ``rank`` (a replacement rollout rank): it has
        the job's store but no default group (the world was formed without it); its groups are
        membership epochs (:attr:`epochs`, rlcomm.elastic)."""
        if self.is_initialized() or self._store is not None:
            raise RlcommError("CommContext is already initialized; call destroy() first")
        self._store = store
        self._backend = "gloo"
        self._timeout = datetime.timedelta(seconds=timeout)
        self._global_ranks[CommMode.GLOBAL] = rank
        self._world_sizes[CommMode.GLOBAL] = world_size

    @property
    def joined_running_job(self: _Context) -> bool:
        """This process joined a running job as a replacement (no default group)."""
        return self._store is not None and not self.is_initialized()

