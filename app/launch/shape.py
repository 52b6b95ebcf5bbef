"""The run's shape (:class:`app.api.RunShape`), derived once in the launching process before any
rank starts: from the layout as declared, the loop (through :class:`app.api.LoopHooks`) and
what the config asks (:class:`Asked`). Each combination that is not supported is refused here,
in one line naming the setting and its value; the ranks get the shape as it is, and the plan
they create their groups from is planned with its flags (app/launch/planning.py).

>>> from rlcomm import LayoutSpec, plan_layout
>>> class Runtime:  # a loop that follows membership and redoes a broken update
...     elastic_rollouts = elastic_trainers = True
...     def __call__(self, ctx, job): return {}
>>> shape = derive_shape(plan_layout(LayoutSpec(world_size=4, trainers=[0, 1])), Runtime())
>>> shape.elastic_rollouts, shape.elastic_trainers, shape.hand_off
(True, True, 'elastic')
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig

from app.api import LoopHooks, RunShape
from app.errors import ConfigError
from rlcomm import LayoutPlan


@dataclass(frozen=True)
class Asked:
    """What the config asks of the shape: ``layout.elastic_rollouts``,
    ``layout.elastic_trainers`` (None: where it can be), ``launcher.trainer_restarts``, and
    ``comm.backend`` as it resolves."""

    elastic_rollouts: bool = True
    elastic_trainers: bool | None = None
    trainer_restarts: int = 0
    backend: str = "gloo"

    @classmethod
    def of(cls, cfg: DictConfig) -> Asked:
        return cls(bool(cfg.layout.elastic_rollouts), cfg.layout.get("elastic_trainers"),
                   int(cfg.launcher.trainer_restarts), _backend(cfg))


def derive_shape(layout: LayoutPlan, loop: object, asked: Asked = Asked()) -> RunShape:
    """The shape of a run of ``loop`` on ``layout`` (its ranks, roles and grid as declared),
    as ``asked``; raises :class:`ConfigError` for a combination that is not supported."""
    hooks = LoopHooks(loop)
    _check_replay_ranks(layout, hooks, loop)
    _data, sequence, tensor = layout.grid_sizes
    sharded = hooks.data_parallel != "ddp" or sequence > 1 or tensor > 1
    if sharded and not hooks.sharded_trainers:
        raise ConfigError(
            f"loop.data_parallel: {hooks.data_parallel} on this layout shards the trainers, but "
            f"{type(loop).__name__} needs DDP trainers (data_parallel=ddp, no tensor or "
            "sequence parallelism)")
    # Rollout ranks are elastic only under a loop that follows membership (the RL runtime's):
    # any other loop's collectives would wait for a lost rank forever. Epoch groups are gloo:
    # with NCCL the rollout ranks stay static.
    elastic_rollouts = (asked.elastic_rollouts and bool(layout.rollouts)
                        and hooks.elastic_rollouts and asked.backend != "nccl")
    shape = RunShape(elastic_rollouts=elastic_rollouts, data_parallel=hooks.data_parallel,
                     sharded=sharded, trainer_replicas=layout.trainer_replicas,
                     replay_ranks=tuple(layout.replay), colocated=layout.colocated)
    return replace(shape, elastic_trainers=_elastic_trainers(layout, shape, hooks, asked))


def _elastic_trainers(layout: LayoutPlan, shape: RunShape, hooks: LoopHooks,
                      asked: Asked) -> bool:
    """Whether a lost trainer leaves the others going (``layout.elastic_trainers``; None: where
    it can be). Asked for where it cannot be, or ``launcher.trainer_restarts`` without it: one
    line naming the setting."""
    why = _why_trainers_stay_static(layout, shape, hooks)
    if asked.elastic_trainers is True and why is not None:
        raise ConfigError(f"layout.elastic_trainers: true, but {why}")
    on = asked.elastic_trainers is not False and why is None
    restarts = asked.trainer_restarts
    if restarts and not on:
        reason = "layout.elastic_trainers=false" if asked.elastic_trainers is False else why
        raise ConfigError(f"launcher.trainer_restarts: {restarts} restarts a lost trainer, but "
                          f"trainers are static here ({reason})")
    if restarts and len(layout.trainers) < 2:
        raise ConfigError(f"launcher.trainer_restarts: {restarts}, but the one trainer is the "
                          "lead, whose loss ends the run (launcher.max_restarts restarts it)")
    if shape.replica_groups:
        _check_replicas(shape, on, why)
    return on and len(layout.trainers) > 1


def _why_trainers_stay_static(layout: LayoutPlan, shape: RunShape,
                              hooks: LoopHooks) -> str | None:
    if not hooks.elastic_trainers:
        return (f"{type(hooks.loop).__name__} is not a loop whose trainers follow membership "
                "(the RL runtime's)")
    if not shape.elastic_rollouts:
        return ("a lost trainer's rollout ranks move to the others: it needs rollout ranks of "
                "their own with layout.elastic_rollouts on (and gloo)")
    if shape.sharded and not shape.replica_groups:
        return ("sharded trainers (loop.data_parallel=fsdp, tensor or sequence parallel) cannot "
                "rebuild a lost shard from its own grid (layout.trainer_replicas=2 or more "
                "makes replica groups that can go on without one)")
    if shape.replay_ranks:
        # The replay ranks serve a fixed set of trainers: their batch shares, rate limit and
        # the end of the run count every trainer (app/runtime/replay/service.py).
        return (f"replay ranks (layout.replay={list(layout.replay)}) serve a fixed set of "
                "trainers; use layout.replay=[] (a replay per trainer) for elastic trainers")
    return None


def _check_replicas(shape: RunShape, elastic: bool, why: str | None) -> None:
    """``layout.trainer_replicas`` > 1: replica groups of sharded trainers that survive a loss
    (docs/failures.md)."""
    replicas = shape.trainer_replicas
    if not shape.sharded:
        raise ConfigError(
            f"layout.trainer_replicas: {replicas}, but under loop.data_parallel=ddp without "
            "tensor or sequence parallelism every trainer is a replica already "
            "(layout.elastic_trainers makes each one survivable); use 1, or shard the trainers "
            "(loop.data_parallel=fsdp, layout.tensor_parallel_size)")
    if not elastic:
        raise ConfigError(f"layout.trainer_replicas: {replicas} makes replica groups that "
                          f"survive a loss, but trainers are static here "
                          f"({why or 'layout.elastic_trainers=false'})")


def _check_replay_ranks(layout: LayoutPlan, hooks: LoopHooks, loop: object) -> None:
    """``layout.replay`` serves a loop that learns from a replay (app/runtime/replay/offpolicy.py);
    its rollout ranks may be static or elastic (app/runtime/replay/service.py)."""
    supported = hooks.replay_ranks_supported
    if not layout.replay or supported is None:  # a loop of its own (commcheck): ranks like others
        return
    if not supported:
        raise ConfigError(
            f"layout.replay: ranks {list(layout.replay)} would hold a replay, but "
            f"{type(loop).__name__} does not learn from one; remove layout.replay (e.g. "
            "layout.replay=[]) or use an off-policy loop (loop=dqn, loop=sac)")


def _backend(cfg: DictConfig) -> str:
    """``comm.backend`` as it will resolve (``auto``: nccl where CUDA is)."""
    from rlcomm.backends import resolve_backend

    backend: Any = cfg.comm.backend
    name = str(getattr(backend, "value", backend))  # the schema's enum, or a plain string
    try:
        return resolve_backend(name)
    except Exception:  # a backend that cannot be had fails with its own error at init
        return name
