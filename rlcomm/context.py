"""CommContext: the process-wide registry of torch.distributed groups per parallel mode.

It keeps the names, arguments, defaults and meaning of the 14 methods of the ``CommContext``
this project started from (``is_initialized``, ``init_distributed_env``, ``get_group``,
``get_world_size``, ``get_global_rank``, ``get_local_rank``, ``get_in_node_rank``,
``get_ranks_in_group``, ``get_local_world_size``, ``get_*_node_process_group``, ``is_main_rank``,
``init_group``, ``destroy``) and fixes what it got wrong (docs/library.md, "The CommContext API").
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import distributed as dist
from torch.distributed import ProcessGroup

from rlcomm.backends import FAKE, resolve_backend
from rlcomm.diagnostics.agreement import agree_on_call
from rlcomm.diagnostics.recorder import FlightRecorder
from rlcomm.diagnostics.watchdog import Watchdog, default_hang_timeout, timeout_problem
from rlcomm.mesh import default_mesh_modes, planned_mesh
from rlcomm.net import env
from rlcomm.plan.layout import LayoutPlan, plan_digest

from .elastic.world import RunningJob
from .errors import EnvironmentConfigError, LayoutError, RlcommError
from .group_initializer import get_initializer
from .modes import CommMode, Mode, mode_name
from .recovery import Recoveries
from .registry import GroupRegistry
from .utils import SingletonMeta

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

class CommContext(GroupRegistry, RunningJob, metaclass=SingletonMeta):
    """Singleton communication context for PyTorch distributed.

    What belongs to one mode's group is a ``get_<what>(comm_mode)`` method, as in the original
    API (``get_group``, ``get_device``, ``get_declared_ranks``); what the context holds once
    is a read-only property (``backend``, ``timeout``, ``store``, ``joined_running_job``). The
    table of groups is :class:`~rlcomm.registry.GroupRegistry`'s; joining a running job,
    :class:`~rlcomm.elastic.world.RunningJob`'s.
    """

    def __init__(self) -> None:
        GroupRegistry.__init__(self)
        RunningJob.__init__(self)
        self._node_cuda_num: int = torch.cuda.device_count()
        self._backend: str = ""
        self._store: dist.Store | None = None
        self._plan: LayoutPlan | None = None
        self._timeout: datetime.timedelta | None = None
        self.recovery = Recoveries()  # per mode: what re-forms a failed group (elastic ones)
        self.recorder = FlightRecorder()
        self.watchdog: Watchdog | None = None

    def is_initialized(self) -> bool:
        """True once ``init_distributed_env`` registered the global group."""
        return self._groups.get(CommMode.GLOBAL) is not None

    def init_distributed_env(
        self,
        world_size: int | None = None,
        rank: int | None = None,
        backend: str = "nccl",
        dist_url: str = "env://",
        timeout: int = 1800,
        *,
        hang_timeout: float | None = None,
        debug: bool = False,
        record: bool = True,
        elastic_member: bool = False,
    ) -> None:
        """Initialise the default process group and register it as GLOBAL.

        ``elastic_member``: this rank is an elastic rollout rank; if its job is running already
        (rlcomm.elastic.is_running), it replaces a lost process and joins without a default
        group (:meth:`join_running_job`, :attr:`joined_running_job`).

        ``world_size``/``rank`` default to WORLD_SIZE/RANK; ``backend`` is nccl, gloo or auto;
        ``timeout`` (seconds) bounds the rendezvous, init and every group created later. A rank
        that never arrives fails every other rank after ``timeout`` with the missing ranks named.

        Every collective of :mod:`rlcomm.collectives` and weight transfer is recorded
        (``record=False`` turns that off); a watchdog thread diagnoses one that has not completed
        after ``hang_timeout`` seconds (default: shortly before ``timeout``), so that it fails
        with :class:`~rlcomm.errors.HangError` naming the ranks that never entered it. ``debug``
        makes every collective first check that its group agrees on (op, dtype, shape).
        """
        if self.is_initialized():
            raise RlcommError("CommContext is already initialized; call destroy() first")
        backend = resolve_backend(backend)
        problem = timeout_problem(timeout, hang_timeout)
        if problem:
            raise ValueError(problem)
        world_size, rank = env.world_size_and_rank(world_size, rank)
        wait = datetime.timedelta(seconds=timeout)

        device_id = self._bind_device() if backend == "nccl" else None
        from rlcomm.net.rendezvous import join_world

        store = join_world(backend, dist_url, rank, world_size, wait)
        if elastic_member:
            from rlcomm.elastic import is_running

            if is_running(store):
                self.join_running_job(store, rank, world_size, timeout)
                return
        dist.init_process_group(backend=backend, store=store, world_size=world_size, rank=rank,
                                timeout=wait, device_id=device_id)
        self._backend = backend
        self._store = store
        self._timeout = wait
        self._register_group(
            rank, world_size, dist.GroupMember.WORLD, list(range(world_size)), CommMode.GLOBAL
        )
        self._global_ranks[CommMode.GLOBAL] = rank
        self._start_recording(record, debug, hang_timeout or default_hang_timeout(timeout))

    def _start_recording(self, record: bool, debug: bool, hang_timeout: float) -> None:
        """The flight recorder, ``debug``'s agreement check and the watchdog, as
        :meth:`init_distributed_env` describes them."""
        self.recorder.enabled = record
        self.recorder.agree = functools.partial(agree_on_call, self) if debug else None
        if record and self._backend != FAKE:
            self.watchdog = Watchdog(
                self.recorder,
                lambda: {mode: info.declared_ranks for mode, info in self.describe().items()},
                self.store,
                self.get_global_rank(),
                self.get_world_size(CommMode.GLOBAL),
                hang_timeout,
                self.timeout.total_seconds(),
            )

    def _bind_device(self) -> torch.device:
        """This rank's GPU, bound before any collective, or NCCL guesses one ("using GPU 0")."""
        device_id = torch.device("cuda", self.get_in_node_rank() % self._node_cuda_num)
        torch.cuda.set_device(device_id)
        return device_id

    def get_in_node_rank(self) -> int:
        """Rank within this node: LOCAL_RANK, else SLURM_LOCALID, else the INTRA_NODE group."""
        from_env = env.in_node_rank()
        if from_env is not None:
            return from_env
        if CommMode.INTRA_NODE in self._local_ranks:
            return self._local_ranks[CommMode.INTRA_NODE]
        raise EnvironmentConfigError(
            "LOCAL_RANK is not set and cannot be derived: set LOCAL_RANK or register an "
            "INTRA_NODE group first"
        )

    def get_local_world_size(self) -> int:
        """Ranks on this node: LOCAL_WORLD_SIZE, else the INTRA_NODE group's size."""
        from_env = env.local_world_size()
        if from_env is not None:
            return from_env
        if CommMode.INTRA_NODE in self._world_sizes:
            return self._world_sizes[CommMode.INTRA_NODE]
        raise EnvironmentConfigError(
            "LOCAL_WORLD_SIZE is not set and cannot be derived: set LOCAL_WORLD_SIZE or register "
            "an INTRA_NODE group first"
        )

    def get_intra_node_process_group(self) -> ProcessGroup:
        return self.get_group(CommMode.INTRA_NODE)

    def get_inter_node_process_group(self) -> ProcessGroup:
        return self.get_group(CommMode.INTER_NODE)

    def is_main_rank(self) -> bool:
        """True on global rank 0."""
        return self.get_global_rank() == 0

    def init_group(
        self,
        ranks: list[int] | list[list[int]],
        mode: Mode | None = None,
        backend: str = "nccl",
        use_cpu: bool = False,
        *,
        group_size: int | None = None,
        tensor_parallel_size: int | None = None,
    ) -> None:
        """Create the group(s) of ``mode`` from ``ranks`` and register the one this rank is in.

        For hand-written layouts; :meth:`init_groups` creates a whole planned layout. ``ranks``
        is one list or several disjoint lists (one group each), validated here; every rank must
        make the same call. For DATA/TENSOR/SEQUENCE_PARALLEL, a flat list plus ``group_size``
        builds the Megatron grid (SEQUENCE_PARALLEL also needs ``tensor_parallel_size``).
        ``use_cpu`` makes a gloo group for CPU tensors whatever ``backend`` says.

        Raises:
            NotImplementedError: If no initializer is registered for ``mode``.
        """
        initializer_cls = get_initializer(mode)
        group_backend = "gloo" if use_cpu else resolve_backend(backend)
        if self._backend == FAKE:
            group_backend = FAKE
        initializer = initializer_cls(
            self.get_global_rank(),
            self.get_world_size(CommMode.GLOBAL),
            ranks,
            mode=mode,
            timeout=self._timeout,
            group_size=group_size,
            tensor_parallel_size=tensor_parallel_size,
        )
        self._register_group(*initializer.init_dist_group(group_backend, use_cpu))

    def init_groups(self, plan: LayoutPlan) -> None:
        """Create every group of a planned layout, in the plan's order, on the context's backend.

        ``plan`` comes from :func:`rlcomm.plan_layout`, which validated it: nothing is validated
        again here. Every rank must pass the same plan; ranks check that cheaply (a digest agreed
        over the rendezvous store) before creating any group, so a rank started with another
        config fails at once instead of hanging in ``new_group``.
        """
        world_size = self.get_world_size(CommMode.GLOBAL)
        if plan.world_size != world_size:
            raise LayoutError(
                f"layout.world_size: the plan has {plan.world_size} ranks but "
                f"init_distributed_env joined {world_size}"
            )
        if self._backend != FAKE:  # the fake backend's store holds nothing
            self._agree_on_plan(plan)
        rank = self.get_global_rank()
        for spec in plan.groups:
            initializer = get_initializer(spec.mode)(
                rank, world_size, spec.rank_lists, mode=spec.mode, timeout=self._timeout
            )
            self._register_group(*initializer.create(spec.rank_lists, self._backend))
        self._plan = plan

    def _agree_on_plan(self, plan: LayoutPlan) -> None:
        """One tiny all_reduce: max of the digests and of their negations. Every rank learns
        whether all digests are equal, so a disagreement fails every rank at once."""
        mine = plan_digest(plan)
        if self.get_global_rank() == 0:
            self.store.set("plan_digest", mine)
        value = int(mine[:15], 16)  # fits int64
        device = self.get_device(CommMode.GLOBAL)
        extremes = torch.tensor([value, -value], dtype=torch.int64, device=device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        if int(extremes[0]) == -int(extremes[1]):
            return
        rank = self.get_global_rank()
        leader = self.store.get("plan_digest").decode()
        if leader != mine:
            raise LayoutError(
                f"rank {rank}: its layout plan differs from rank 0's (digest {mine[:12]} vs "
                f"{leader[:12]}); start every rank with the same layout config"
            )
        raise LayoutError(
            f"rank {rank}: some ranks were started with another layout plan than rank 0's "
            f"(digest {leader[:12]}); start every rank with the same layout config"
        )

    def device_mesh(self, modes: Sequence[Mode] | None = None) -> DeviceMesh:
        """A ``DeviceMesh`` over the planned DATA/SEQUENCE/TENSOR_PARALLEL grid, for DTensor /
        FSDP2 users. Its dimensions are named after the modes and reuse the groups rlcomm created
        (no second communicator). ``modes`` are outer to inner; by default DATA_PARALLEL,
        SEQUENCE_PARALLEL (when its groups have more than one rank) and TENSOR_PARALLEL."""
        from torch.distributed.device_mesh import DeviceMesh

        if self._plan is None:
            raise RlcommError("device_mesh() needs a planned layout: call init_groups(plan) first")
        names = [mode_name(m) for m in modes] if modes is not None else default_mesh_modes(self._plan)
        mesh = planned_mesh(self._plan, names, self.get_global_rank())
        device = self.get_device(names[0]).type
        in_world = torch.tensor(self.world_ranks(mesh.flatten().tolist())).reshape(mesh.shape)
        return DeviceMesh.from_group(
            [self.get_group(name) for name in names], device, mesh=in_world,
            mesh_dim_names=tuple(names)
        )

    @property
    def timeout(self) -> datetime.timedelta:
        """The timeout every group was created with (``init_distributed_env``'s)."""
        return self._timeout or datetime.timedelta(seconds=1800)

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def store(self) -> dist.Store:
        """The rendezvous store this rank joined with: a side channel that works even while a
        process group is stuck (private to this init, so keys never leak into a re-init)."""
        if self._store is None:
            raise RlcommError("CommContext is not initialized: call init_distributed_env() first")
        return self._store

    def destroy(self, barrier: bool = True) -> None:
        """Tear down every group and reset the context so it can be initialised again.
        ``barrier=False``: no last barrier over the world (members of it may be gone)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.is_initialized():
            try:
                if self._backend != FAKE and barrier:
                    dist.barrier()  # nobody tears down while a peer is still sending
            finally:
                dist.destroy_process_group()
        elif self._world_ranks and dist.is_initialized():  # a sub-world's own default group
            dist.destroy_process_group()
        self.__init__()  # type: ignore[misc]
