"""Config -> validated layout plan and the typed job the ranks receive, in the launching
process, before any rank starts."""

from __future__ import annotations

import dataclasses
import importlib
import math
import pickle
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from app.api import LoopHooks
from app.config import build_loop, loop_schema
from app.config.schema import AppConfig
from app.errors import ConfigError
from app.metrics import check_metric_name
from rlcomm import LayoutPlan, LayoutSpec, plan_layout
from rlcomm.diagnostics.watchdog import timeout_problem


def build_plan(cfg: DictConfig) -> LayoutPlan:
    layout: dict[str, Any] = OmegaConf.to_container(cfg.layout, resolve=True)  # type: ignore[assignment]
    return plan_layout(LayoutSpec(**layout))


def check_world_size(plan: LayoutPlan, world_size: int, rank: int) -> None:
    """A joined job's rank count must be the layout's; fail before any group exists."""
    if world_size != plan.world_size:
        raise ConfigError(
            f"layout.world_size: {plan.world_size} but this job has {world_size} ranks "
            f"(rank {rank}); pick a layout of {world_size} ranks or change the allocation"
        )


def check_restarts(max_restarts: int, agent_limit: int | None) -> None:
    """Under torchrun its agent restarts the ranks, as often as its ``--max-restarts`` says:
    a different ``launcher.max_restarts`` (which configures the app's own launch) would mislead."""
    if agent_limit is not None and max_restarts not in (0, agent_limit):
        raise ConfigError(
            f"launcher.max_restarts: {max_restarts}, but torchrun restarts these ranks and was "
            f"started with --max-restarts {agent_limit}; pass --max-restarts {max_restarts} to "
            "torchrun instead"
        )


def validate(cfg: DictConfig) -> LayoutPlan:
    """Everything that can be checked without starting a process; raises one-line errors."""
    return validate_job(cfg)[0]


def validate_job(cfg: DictConfig, probe: bool = True) -> tuple[LayoutPlan, AppConfig]:
    """:func:`validate`, and the config in the one typed form its ranks receive: an
    :class:`AppConfig` whose ``loop`` is the loop that validation built and checked, with what
    it learnt by building things (the env's spaces), so that a rank builds neither again.

    ``probe=False``: the loop's checks that build things (its ``validate_env``: an env to probe
    its spaces, a policy) are left to another process, which hands this one the env's spaces:
    rank 0 of a joined run, for the other ranks (app/launch/rank.py). A loop without
    ``validate_settings`` runs its whole ``validate`` anyway (app.api.Loop's default)."""
    problem = timeout_problem(cfg.comm.timeout, cfg.comm.get("hang_timeout"), prefix="comm.")
    if problem:
        raise ConfigError(problem)
    if cfg.launcher.max_restarts < 0:
        raise ConfigError(f"launcher.max_restarts: must be >= 0, got {cfg.launcher.max_restarts}")
    for key in ("rollout_restarts", "trainer_restarts"):
        if cfg.launcher[key] < 0:
            raise ConfigError(f"launcher.{key}: must be >= 0, got {cfg.launcher[key]}")
    for key in ("monitor_interval", "shutdown_timeout"):
        seconds = cfg.launcher[key]
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ConfigError(f"launcher.{key}: must be a positive number of seconds, got {seconds}")
    _check_target(cfg.loop)
    if cfg.sweep.rank_by is not None:  # the configured loop's declared metrics, or the app's
        check_metric_name(cfg.sweep.rank_by, str(cfg.loop._target_))
    plan = build_plan(cfg)
    loop = _check_loop(cfg.loop, plan, int(cfg.seed), probe)
    # Rollout ranks are elastic only under a loop that follows membership (the RL runtime's):
    # any other loop's collectives would wait for a lost rank forever.
    # Epoch groups are gloo: with NCCL the rollout ranks stay static.
    elastic = (plan.elastic_rollouts and LoopHooks(loop).elastic_rollouts
               and _backend(cfg) != "nccl")
    _check_replay_ranks(plan, loop)
    trainers = _elastic_trainers(cfg, plan, loop, elastic)
    return (dataclasses.replace(plan, elastic_rollouts=elastic, elastic_trainers=trainers),
            typed_job(cfg, loop))


def _elastic_trainers(cfg: DictConfig, plan: LayoutPlan, loop: Any, elastic_rollouts: bool) -> bool:
    """Whether a lost trainer leaves the others going (``layout.elastic_trainers``; null: where
    it can be). Asked for where it cannot be, or ``launcher.trainer_restarts`` without it: one
    line naming the setting."""
    asked, restarts = cfg.layout.get("elastic_trainers"), int(cfg.launcher.trainer_restarts)
    why = _why_trainers_stay_static(plan, loop, elastic_rollouts)
    if asked is True and why is not None:
        raise ConfigError(f"layout.elastic_trainers: true, but {why}")
    on = asked is not False and why is None
    if restarts and not on:
        reason = "layout.elastic_trainers=false" if asked is False else why
        raise ConfigError(f"launcher.trainer_restarts: {restarts} restarts a lost trainer, but "
                          f"trainers are static here ({reason})")
    if restarts and len(plan.trainers) < 2:
        raise ConfigError(f"launcher.trainer_restarts: {restarts}, but the one trainer is the "
                          "lead, whose loss ends the run (launcher.max_restarts restarts it)")
    if plan.trainer_replicas > 1:
        _check_replicas(plan, loop, on, why)
    return on and len(plan.trainers) > 1


def _check_replicas(plan: LayoutPlan, loop: Any, elastic: bool, why: str | None) -> None:
    """``layout.trainer_replicas`` > 1: replica groups of sharded trainers that survive a loss
    (docs/failures.md)."""
    replicas = plan.trainer_replicas
    if not _sharded(plan, loop):
        raise ConfigError(
            f"layout.trainer_replicas: {replicas}, but under loop.data_parallel=ddp without "
            "tensor or sequence parallelism every trainer is a replica already "
            "(layout.elastic_trainers makes each one survivable); use 1, or shard the trainers "
            "(loop.data_parallel=fsdp, layout.tensor_parallel_size)")
    if not elastic:
        raise ConfigError(f"layout.trainer_replicas: {replicas} makes replica groups that "
                          f"survive a loss, but trainers are static here "
                          f"({why or 'layout.elastic_trainers=false'})")


def _sharded(plan: LayoutPlan, loop: Any) -> bool:
    _data, sequence, tensor = plan.grid_sizes
    return getattr(loop, "data_parallel", "ddp") != "ddp" or sequence > 1 or tensor > 1


def _why_trainers_stay_static(plan: LayoutPlan, loop: Any, elastic_rollouts: bool) -> str | None:
    if not LoopHooks(loop).elastic_trainers:
        return f"{type(loop).__name__} is not a loop whose trainers follow membership (the RL runtime's)"
    if not elastic_rollouts or plan.colocated:
        return ("a lost trainer's rollout ranks move to the others: it needs rollout ranks of "
                "their own with layout.elastic_rollouts on (and gloo)")
    if _sharded(plan, loop) and plan.trainer_replicas == 1:
        return ("sharded trainers (loop.data_parallel=fsdp, tensor or sequence parallel) cannot "
                "rebuild a lost shard from its own grid (layout.trainer_replicas=2 or more "
                "makes replica groups that can go on without one)")
    return None


def _check_replay_ranks(plan: LayoutPlan, loop: Any) -> None:
    """``layout.replay`` serves a loop that learns from a replay (app/runtime/replay/offpolicy.py);
    its rollout ranks may be static or elastic (app/runtime/replay/service.py)."""
    if not plan.replay:
        return
    ranks = list(plan.replay)
    supported = LoopHooks(loop).replay_ranks_supported
    if supported is None:  # a loop of its own (commcheck): replay ranks are ranks like others
        return
    if not supported:
        raise ConfigError(
            f"layout.replay: ranks {ranks} would hold a replay, but {type(loop).__name__} does "
            "not learn from one; remove layout.replay (e.g. layout.replay=[]) or use an "
            "off-policy loop (loop=dqn, loop=sac)")
    batch = loop.replay.batch_size  # every replay rank gives a share of each batch
    if batch < len(ranks):
        raise ConfigError(
            f"loop.replay.batch_size: {batch} is fewer than the {len(ranks)} replay ranks "
            f"{ranks}, which each give a share of every batch; use at least {len(ranks)}")


def typed_job(cfg: DictConfig, loop: Any) -> AppConfig:
    """``cfg`` as its schema's dataclasses, its ``loop`` the built ``loop``; one that will not
    pickle (the local launcher sends it to every rank) is one line naming it."""
    rest = cfg.copy()
    rest.loop = None  # the built loop replaces its settings
    job = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AppConfig), rest))
    assert isinstance(job, AppConfig), type(job)
    job.loop = loop
    try:
        pickle.dumps(job)
    except Exception as err:
        raise ConfigError(f"loop: a built {type(loop).__name__} does not pickle ({err}); the "
                          "ranks receive the validated loop, so its fields must pickle") from None
    return job


def _backend(cfg: DictConfig) -> str:
    """``comm.backend`` as it will resolve (``auto``: nccl where CUDA is)."""
    from rlcomm.backends import resolve_backend

    backend = cfg.comm.backend
    name = str(getattr(backend, "value", backend))  # the schema's enum, or a plain string
    try:
        return resolve_backend(name)
    except Exception:  # a backend that cannot be had fails with its own error at init
        return name


def _check_loop(loop: DictConfig, plan: LayoutPlan, seed: int, probe: bool = True) -> Any:
    """Type-check the loop's settings against its dataclass (unknown keys included), build it
    once so bad arguments fail before any rank starts, then run its ``validate(plan)`` (or,
    without ``probe``, its ``validate_settings(plan)``) and ``check_seed(seed, plan)`` (the
    seeds its ranks derive): app.api.Loop's hooks, with their defaults."""
    from hydra.utils import get_object
    from omegaconf.errors import OmegaConfBaseException

    target = get_object(str(loop._target_))
    if dataclasses.is_dataclass(target):
        try:
            settings = OmegaConf.to_container(loop, resolve=True)
            OmegaConf.merge(OmegaConf.structured(loop_schema(target)), settings)  # type: ignore[arg-type]
        except OmegaConfBaseException as err:
            raise ConfigError(_schema_error(err, target, loop)) from None
    try:
        built = build_loop(loop)
    except Exception as err:
        raise ConfigError(f"loop: cannot build {loop.get('_target_')!r}: {err}") from None
    hooks = LoopHooks(built)
    if probe:
        hooks.validate(plan)
    else:
        hooks.validate_settings(plan)
    hooks.check_seed(seed, plan)
    return built


def _schema_error(err: Exception, target: Any, loop: DictConfig) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or ""
    first = str(err).splitlines()[0]
    if isinstance(err, ConfigKeyError):
        name = f"{target.__module__}.{target.__qualname__}"
        hint = ""
        if OmegaConf.get_type(loop) is not dict:  # a shipped loop's settings, kept under a new target
            hint = "; to run your own loop start from loop=custom: loop=custom loop._target_=..."
        return f"loop.{key}: not a setting of {name}{hint}"
    return f"loop.{key}: {first}"


def _check_target(loop: Any) -> None:
    target = loop.get("_target_") if isinstance(loop, DictConfig) else None
    if not target:
        raise ConfigError("loop._target_: missing; pick a loop, e.g. loop=commcheck")
    module_name, _, attr = str(target).rpartition(".")
    try:
        module = importlib.import_module(module_name)
        getattr(module, attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"loop._target_: cannot import {target!r} ({err})") from None
