"""What a loop plugin imports: the whole surface between the app and a loop.

A loop is ``loop(ctx, job) -> dict``; it gets the group registry and a :class:`JobInfo`, declares
its settings with :func:`setting` and rejects bad values with :class:`ConfigError`. This module
imports nothing else from ``app``, so a loop never pulls in the launcher, and nothing the app
imports can form a cycle through a loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from omegaconf import MISSING

from rlcomm import LayoutPlan, RlcommError
from rlcomm.net.env import (
    LOCAL_RANK,
    LOCAL_WORLD_SIZE,
    MASTER_ADDR,
    MASTER_PORT,
    RANK,
    WORLD_SIZE,
)

if TYPE_CHECKING:
    from rlcomm import CommContext


def setting(default: Any = MISSING, doc: str = "", *, factory: Any = None) -> Any:
    """A config field with its one-line doc; ``factory`` for mutable defaults."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


class ConfigError(RlcommError, ValueError):
    """A config value the schema's types cannot catch; the message names field and value."""


@dataclass(frozen=True)
class RankEnv:
    """How this process was started and which rank it is.

    ``launcher`` is ``local`` when this process launches the layout's ranks itself; otherwise how
    the rank was started: ``torchrun`` (torch's elastic agent, the app's own local launch
    included), ``ray`` (a rank the Ray engine's actor started), ``slurm``, ``submitit`` (a local
    submitit task) or ``env`` (RANK/WORLD_SIZE by hand).
    """

    launcher: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node: str = ""  # this host's name
    master_addr: str = ""
    master_port: int | None = None
    restart_count: int = 0  # how often the ranks were restarted (elastic agent, SLURM requeue)
    max_restarts: int | None = None  # the elastic agent's limit (torchrun --max-restarts)
    run_name: str | None = None  # the run directory every rank of a joined run agrees on
    note: str | None = None  # something the user should know about how the app was started

    @property
    def joins(self) -> bool:
        """True when this process is one rank of a job something else launched."""
        return self.launcher != "local"

    def torch_variables(self) -> dict[str, str]:
        """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torch
        and rlcomm read them (none for a process that launches the ranks itself)."""
        if not self.joins:
            return {}
        values = {
            RANK: self.rank,
            WORLD_SIZE: self.world_size,
            LOCAL_RANK: self.local_rank,
            LOCAL_WORLD_SIZE: self.local_world_size,
            MASTER_ADDR: self.master_addr,
            MASTER_PORT: self.master_port,
        }
        return {name: str(value) for name, value in values.items() if value not in ("", None)}


HandOffKind = Literal["flat", "sharded", "elastic", "elastic-sharded"]


@dataclass(frozen=True)
class RunShape:
    """How the run behaves, as opposed to who does what (the plan's ranks, roles and groups):
    which of its ranks may come and go, how its trainers hold the model, where its replay
    lives. The launcher derives it once, before any rank starts, from the layout, the loop
    and the backend, refusing there each combination that is not supported in one line
    (app/launch/shape.py, as torchtitan's ``ParallelDims``); every rank gets it as it is, in
    :attr:`JobInfo.shape`, and nothing else derives these facts (docs/layouts.md, "The run's
    shape"). The default is a static run of unsharded trainers.

    >>> RunShape(elastic_rollouts=True, sharded=True, data_parallel="fsdp").hand_off
    'elastic-sharded'
    """

    #: Rollout ranks (there are some) may leave and join while the run goes on
    #: (``layout.elastic_rollouts``, under a loop that follows membership, on gloo).
    elastic_rollouts: bool = False
    #: A lost trainer other than the lead leaves the others training (``layout.elastic_trainers``).
    elastic_trainers: bool = False
    #: How the trainers share the work (``loop.data_parallel``): ``ddp`` or ``fsdp``.
    data_parallel: str = "ddp"
    #: The trainers train a sharded copy of the model (FSDP, or a tensor- or sequence-parallel
    #: grid) rather than the acting module itself under DDP (docs/sharding.md).
    sharded: bool = False
    #: Replica groups the trainers form (``layout.trainer_replicas``); 1: one grid.
    trainer_replicas: int = 1
    #: The ranks that hold the replay (``layout.replay``); empty: a replay per trainer, if any.
    replay_ranks: tuple[int, ...] = ()
    #: The trainers collect themselves: there are no rollout ranks.
    colocated: bool = False

    @property
    def replica_groups(self) -> bool:
        """Sharded trainers in replica groups that go on without a lost one (docs/failures.md)."""
        return self.trainer_replicas > 1

    @property
    def shards_weights(self) -> bool:
        """The weights go to the acting ranks as each shard owner's slices: sharded trainers in
        one grid (replica groups hand whole weights: a lost group would take its owners' shards)."""
        return self.sharded and not self.replica_groups

    @property
    def forwards(self) -> bool:
        """The trainers write the collectors' segments on to the replay ranks, rather than the
        collectors themselves: elastic rollout ranks, which may have joined the running job
        without a static group to the replay ranks (app/runtime/replay/service.py)."""
        return bool(self.replay_ranks) and self.elastic_rollouts

    @property
    def hand_off(self) -> HandOffKind:
        """The hand-off between trainers and acting ranks (a replay rank's own is ``replay``):
        docs/sharding.md's table."""
        if self.elastic_rollouts:
            return "elastic-sharded" if self.shards_weights else "elastic"
        return "sharded" if self.shards_weights and not self.colocated else "flat"


@dataclass(frozen=True)
class JobInfo:
    """What a loop gets besides the group registry."""

    plan: LayoutPlan
    run_dir: Path
    seed: int
    rank: int
    env: RankEnv  # how this rank was started (restart count, host, launcher)
    shape: RunShape  # how the run behaves, as the launcher derived it (elastic, sharded, ...)
    # An elastic rollout rank that replaces a lost one in a running job (rlcomm.elastic): it
    # has no GLOBAL group and is admitted by its trainer.
    joining: bool = False
    hosts: Mapping[int, str] = field(default_factory=dict)  # rank -> host, as the ranks started
    # How often the app's local launcher starts a lost rollout rank again; None: a replacement
    # may be started by hand (torchrun, srun, RANK/WORLD_SIZE), so one can always come.
    rollout_restarts: int | None = None
    # The same for a lost trainer (layout.elastic_trainers, launcher.trainer_restarts).
    trainer_restarts: int | None = None
    # Seconds a rank asked to stop (SIGTERM) has to end its update and write its last
    # checkpoint before it ends as SIGTERM would (launcher.shutdown_timeout).
    stop_grace_s: float = 5.0


Direction = Literal["min", "max"]  # lower or higher is better


@dataclass(frozen=True)
class LoopMetrics:
    """The figures a loop reports in its result's ``metrics`` mapping, and which way each one
    is better; a loop class declares them as ``metrics: ClassVar[LoopMetrics] = LoopMetrics(...)``.

    ``sweep.rank_by`` accepts these names plus the app's own (``startup_s``,
    ``group_creation_s``, ``wall_s``). A figure reported per group as ``<name>:<group>`` (e.g.
    ``latency_us:GLOBAL[0,1]``) takes ``<name>``'s direction. ``headline``: the sweep table's
    columns, the first one what a sweep ranks by when ``sweep.rank_by`` is not set (empty: the
    app's ``wall_s``, ``startup_s``).
    """

    directions: Mapping[str, Direction]
    headline: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        wrong = {name: how for name, how in self.directions.items() if how not in ("min", "max")}
        if wrong:
            raise ValueError(f"LoopMetrics: a direction is 'min' or 'max', got {wrong}")


class Loop(Protocol):
    """A training loop: ``loop(ctx, job) -> dict`` (JSON-serialisable), called on every rank.

    Build one with ``loop._target_=mypkg.MyLoop`` plus its constructor arguments; it receives the
    registry explicitly and must not reach for ``CommContext()`` itself.

    Besides ``__call__`` the app asks a loop for the members below, each with its default here.
    A loop defines the ones it changes and need subclass nothing: the app reads every one
    through :class:`LoopHooks`, which answers with this default where the loop has no member of
    that name (a class that subclasses ``Loop`` inherits the same defaults).
    """

    #: The figures its result's ``metrics`` mapping reports, and which way each is better (what
    #: a sweep ranks by); declared on the class. Default: none (the app's own still count).
    metrics: ClassVar[LoopMetrics] = LoopMetrics({})
    #: Whether its rollout ranks may be elastic (``layout.elastic_rollouts``): only a loop that
    #: follows membership may say True, or its collectives would wait for a lost rank forever.
    elastic_rollouts: ClassVar[bool] = False
    #: Whether its trainers may be elastic (``layout.elastic_trainers``): a loop that re-runs
    #: an update a lost trainer broke, on the survivors (the RL runtime's).
    elastic_trainers: ClassVar[bool] = False
    #: Whether ``layout.replay`` may hold its replay: True (it learns from one), False (it does
    #: not: replay ranks are refused), or None (the default: replay ranks are ranks like others).
    replay_ranks_supported: ClassVar[bool | None] = None
    #: Whether its trainers may train a sharded copy of the model (``loop.data_parallel=fsdp``,
    #: a tensor- or sequence-parallel layout): False for a loop whose update has no sharded form.
    sharded_trainers: ClassVar[bool] = True
    #: How its trainers share the work, where it has the setting (``loop.data_parallel``):
    #: ``ddp``, or ``fsdp`` (sharded); the launcher derives the run's shape from it.
    data_parallel: str = "ddp"
    #: Intra-op threads it asks for per rank, where it has the setting (``loop.threads``); 0: the
    #: launcher's share, the node's cores over its ranks.
    threads: int = 0

    def __call__(self, ctx: CommContext, job: JobInfo) -> dict[str, Any]: ...

    def validate(self, plan: LayoutPlan) -> None:
        """Every check of the settings against ``plan`` before any rank starts, building what
        it must (an env to probe its spaces); raises :class:`ConfigError`. Default: none."""
        return None

    def validate_settings(self, plan: LayoutPlan) -> None:
        """The checks of :meth:`validate` that build nothing: the only ones run where another
        process builds (ranks other than rank 0 of a joined run, a SLURM sweep's submitting
        host). Default: the whole :meth:`validate`."""
        LoopHooks(self).validate(plan)

    def check_seed(self, seed: int, plan: LayoutPlan) -> None:
        """Checks the top-level ``seed`` against the seeds its ranks derive from it; raises
        :class:`ConfigError`. Default: none."""
        return None

    def summary(self, result: dict[str, Any], run_dir: Path) -> dict[str, Any] | None:
        """Figures (and ``files``: name -> path) for the closing summary, from rank 0's
        ``result``. Default: None, nothing added."""
        return None

    def reporting_ranks(self, ctx: CommContext, plan: LayoutPlan,
                        timeout_s: float) -> list[int]:
        """The ranks whose reports rank 0 collects through the store at the end of a run with
        elastic groups (no group spans every rank then), waiting up to ``timeout_s`` for the
        loop's own records of who was there. Default: every rank of the plan."""
        return list(range(plan.world_size))


_ABSENT = object()


class LoopHooks:
    """What the app asks a loop besides running it: the loop's own member where it has one,
    else :class:`Loop`'s default. The one place the app reads a loop's hooks and the settings
    it reads of any loop (``data_parallel``, ``threads``), so that a loop need not subclass
    anything. ``loop``: a built loop, or a loop class (for ``metrics``).

    >>> class Count:
    ...     def __call__(self, ctx, job): return {}
    >>> hooks = LoopHooks(Count())
    >>> hooks.elastic_rollouts, hooks.replay_ranks_supported, hooks.metrics.directions
    (False, None, {})
    >>> hooks.data_parallel, hooks.threads  # the settings the launcher reads, where it has them
    ('ddp', 0)
    """

    def __init__(self, loop: object) -> None:
        self.loop = loop

    def _value(self, name: str) -> Any:
        own = getattr(self.loop, name, _ABSENT)
        return vars(Loop)[name] if own is _ABSENT else own

    def _method(self, name: str) -> Any:
        own = getattr(self.loop, name, None)
        if callable(own):
            return own
        return MethodType(vars(Loop)[name], self.loop)  # a setting of that name is no hook

    @property
    def metrics(self) -> LoopMetrics:
        declared = self._value("metrics")
        return declared if isinstance(declared, LoopMetrics) else LoopMetrics({})

    @property
    def elastic_rollouts(self) -> bool:
        return bool(self._value("elastic_rollouts"))

    @property
    def elastic_trainers(self) -> bool:
        return bool(self._value("elastic_trainers"))

    @property
    def replay_ranks_supported(self) -> bool | None:
        supported = self._value("replay_ranks_supported")
        return None if supported is None else bool(supported)

    @property
    def sharded_trainers(self) -> bool:
        return bool(self._value("sharded_trainers"))

    @property
    def data_parallel(self) -> str:
        return str(self._value("data_parallel"))

    @property
    def threads(self) -> int:
        return int(self._value("threads"))

    def validate(self, plan: LayoutPlan) -> None:
        self._method("validate")(plan)

    def validate_settings(self, plan: LayoutPlan) -> None:
        self._method("validate_settings")(plan)

    def check_seed(self, seed: int, plan: LayoutPlan) -> None:
        self._method("check_seed")(seed, plan)

    def summary(self, result: dict[str, Any], run_dir: Path) -> dict[str, Any] | None:
        figures: dict[str, Any] | None = self._method("summary")(result, run_dir)
        return figures

    def reporting_ranks(self, ctx: CommContext, plan: LayoutPlan, timeout_s: float) -> list[int]:
        ranks: list[int] = self._method("reporting_ranks")(ctx, plan, timeout_s)
        return ranks
