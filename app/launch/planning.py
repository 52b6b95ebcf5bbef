"""Config -> validated layout plan, the run's shape and the typed job the ranks receive, in the
launching process, before any rank starts."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import pickle
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from app.api import LoopHooks, RunShape
from app.config import build_loop, loop_schema
from app.config.schema import AppConfig
from app.errors import ConfigError
from app.launch.shape import Asked, derive_shape
from app.metrics import check_metric_name
from rlcomm import LayoutPlan, LayoutSpec, plan_layout
from rlcomm.diagnostics.watchdog import timeout_problem


def layout_spec(cfg: DictConfig) -> LayoutSpec:
    """``layout``, as the config declares it."""
    layout: dict[str, Any] = OmegaConf.to_container(cfg.layout, resolve=True)  # type: ignore[assignment]
    return LayoutSpec(**layout)


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


@dataclass
class ValidatedJob(AppConfig):
    """What validation hands the launcher, which hands it to every rank as it is: the config in
    its typed form (its ``loop`` the loop validation built and checked) and the run's shape
    derived from it (:class:`app.api.RunShape`, app/launch/shape.py)."""

    shape: RunShape = field(default_factory=RunShape)


def validate(cfg: DictConfig) -> LayoutPlan:
    """Everything that can be checked without starting a process; raises one-line errors."""
    return validate_job(cfg)[0]


def validate_job(cfg: DictConfig, probe: bool = True) -> tuple[LayoutPlan, ValidatedJob]:
    """:func:`validate`, and the config in the one typed form its ranks receive: a
    :class:`ValidatedJob` whose ``loop`` is the loop that validation built and checked, with
    what it learnt by building things (the env's spaces), so that a rank builds neither again,
    and whose ``shape`` is the run's.

    The layout is planned as declared, for its ranks, roles and grid; the run's shape is
    derived from it and the loop, refusing what is not supported (app/launch/shape.py); the
    plan the ranks get is planned with the shape's flags (which rollout ranks and trainers are
    elastic: rlcomm's ``LayoutPlan.is_elastic_rank``), and the loop is checked against it.

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
    if cfg.launcher.engine == "ray":
        check_ray_settings(cfg.launcher.ray)
    _check_target(cfg.loop)
    if cfg.sweep.rank_by is not None:  # the configured loop's declared metrics, or the app's
        check_metric_name(cfg.sweep.rank_by, str(cfg.loop._target_))
    declared = layout_spec(cfg)
    layout = plan_layout(declared)  # a bad layout is one line before the loop is built
    loop = _build_loop(cfg.loop)
    shape = derive_shape(layout, loop, Asked.of(cfg))
    plan = plan_layout(dataclasses.replace(declared, elastic_rollouts=shape.elastic_rollouts,
                                           elastic_trainers=shape.elastic_trainers))
    _check_loop(loop, plan, int(cfg.seed), probe)
    check_max_rollouts(cfg.launcher, plan, shape)
    return plan, typed_job(cfg, loop, shape)


def check_max_rollouts(launcher: Any, plan: LayoutPlan, shape: RunShape) -> None:
    """``launcher.ray.max_rollouts``: for the Ray engine, with elastic rollout ranks, at least
    the planned ones."""
    wanted = launcher.ray.max_rollouts
    if wanted is None:
        return
    key = f"launcher.ray.max_rollouts={wanted}"
    if launcher.engine != "ray":
        raise ConfigError(f"{key}: the Ray engine's (launcher.engine=ray); under "
                          "launcher.engine=local, add rollout ranks with python -m app.join")
    if not shape.elastic_rollouts:
        raise ConfigError(f"{key}: needs elastic rollout ranks (layout.elastic_rollouts=true, "
                          "rollout ranks apart from the trainers, on gloo)")
    if wanted < len(plan.rollouts):
        raise ConfigError(f"{key}: at least the layout's {len(plan.rollouts)} rollout ranks")


def check_ray_settings(ray: Any) -> None:
    """``launcher.engine=ray``'s settings, checked without Ray or a cluster: Ray installed, the
    resources per rank and the placement timeout in range, the address's form. Reaching the
    address and fitting the cluster are checked by the engine, before any actor starts."""
    try:
        found = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # a "ray" that cannot be imported is no Ray either
        found = False
    if not found:
        raise ConfigError("launcher.engine=ray: Ray is not installed; install it with "
                          "pip install -c constraints.txt -e '.[ray]'")
    for key in ("cpus_per_rank", "gpus_per_rank"):
        if not (ray[key] >= 0 and math.isfinite(ray[key])):
            raise ConfigError(f"launcher.ray.{key}: must be >= 0, got {ray[key]}")
    if ray.cpus_per_rank == 0 and ray.gpus_per_rank == 0:
        raise ConfigError("launcher.ray.cpus_per_rank=0 with launcher.ray.gpus_per_rank=0: a "
                          "rank must reserve some CPU or GPU to be placed")
    if not (ray.placement_timeout > 0 and math.isfinite(ray.placement_timeout)):
        raise ConfigError("launcher.ray.placement_timeout: must be a positive number of seconds, "
                          f"got {ray.placement_timeout}")
    address = ray.address
    if address not in (None, "auto"):
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"launcher.ray.address: {address!r} is not null, auto or "
                              "host:port of a Ray head")


def typed_job(cfg: DictConfig, loop: Any, shape: RunShape) -> ValidatedJob:
    """``cfg`` as its schema's dataclasses, its ``loop`` the built ``loop``, with the run's
    ``shape``; one that will not pickle (the local launcher sends it to every rank) is one line
    naming it."""
    rest = cfg.copy()
    rest.loop = None  # the built loop replaces its settings
    typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AppConfig), rest))
    assert isinstance(typed, AppConfig), type(typed)
    job = ValidatedJob(**{**vars(typed), "loop": loop}, shape=shape)
    try:
        pickle.dumps(job)
    except Exception as err:
        raise ConfigError(f"loop: a built {type(loop).__name__} does not pickle ({err}); the "
                          "ranks receive the validated loop, so its fields must pickle") from None
    return job


def _build_loop(loop: DictConfig) -> Any:
    """Type-check the loop's settings against its dataclass (unknown keys included), then build
    it once, so that bad arguments fail before any rank starts."""
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
        return build_loop(loop)
    except Exception as err:
        raise ConfigError(f"loop: cannot build {loop.get('_target_')!r}: {err}") from None


def _check_loop(loop: Any, plan: LayoutPlan, seed: int, probe: bool = True) -> None:
    """The built loop's ``validate(plan)`` (or, without ``probe``, its
    ``validate_settings(plan)``) and ``check_seed(seed, plan)`` (the seeds its ranks derive):
    app.api.Loop's hooks, with their defaults."""
    hooks = LoopHooks(loop)
    if probe:
        hooks.validate(plan)
    else:
        hooks.validate_settings(plan)
    hooks.check_seed(seed, plan)


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
