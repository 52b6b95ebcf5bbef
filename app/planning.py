"""Config -> validated layout plan, in the launching process, before any rank starts."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlcomm import LayoutPlan, LayoutSpec, plan_layout

from .errors import ConfigError
from .metrics import check_metric_name


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


def validate(cfg: DictConfig) -> LayoutPlan:
    """Everything that can be checked without starting a process; raises one-line errors."""
    timeout = cfg.comm.timeout
    if timeout <= 0:
        raise ConfigError(f"comm.timeout: must be a positive number of seconds, got {timeout}")
    if cfg.launcher.max_restarts < 0:
        raise ConfigError(f"launcher.max_restarts: must be >= 0, got {cfg.launcher.max_restarts}")
    if cfg.sweep.rank_by is not None:
        check_metric_name(cfg.sweep.rank_by)
    _check_target(cfg.loop)
    _check_loop(cfg.loop)
    return build_plan(cfg)


def build_loop(loop: DictConfig) -> Any:
    """``instantiate(loop)``, keeping only the arguments the target accepts.

    ``loop._target_=mypkg.MyLoop`` on top of the default ``loop=ppo`` would otherwise hand
    PPO's settings to a class that has none of them; typos cannot slip through this way, since
    Hydra rejects unknown keys when composing.
    """
    from hydra.utils import get_object, instantiate

    target = get_object(str(loop._target_))
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return instantiate(loop)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return instantiate(loop)
    accepted = {p.name for p in params}
    kept = {k: v for k, v in loop.items() if str(k).startswith("_") or k in accepted}
    return instantiate(OmegaConf.create(kept))


def _check_loop(loop: DictConfig) -> None:
    """Build the loop once here so bad arguments fail before any rank starts; a loop may add
    its own checks in a ``validate()`` method (e.g. that a resume path holds a checkpoint)."""
    try:
        built = build_loop(loop)
    except Exception as err:
        raise ConfigError(f"loop: cannot build {loop.get('_target_')!r}: {err}") from None
    check = getattr(built, "validate", None)
    if callable(check):
        check()


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
