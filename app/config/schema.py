"""Structured config schemas, registered in Hydra's ConfigStore.

Plain dataclasses whose fields carry a one-line doc (``setting(default, "doc")``, shown by
``python -m app --help``): OmegaConf type-checks every override against them and rejects unknown
keys (``comm.timeout=abc``, ``loop.hparams.num_envs=abc``, ``loop.nosuch=1``) before anything
starts; ``app.launch.planning.validate`` range-checks what types cannot. A loop is a dataclass too and is
its own schema (:func:`loop_schema`); shipped loops are registered as ``loop/<name>_schema``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from app.api import setting
from rlcomm import Backend, LayoutSpec


@dataclass
class CommConfig:
    backend: Backend = setting(Backend.gloo, "gloo (CPU), nccl (CUDA) or auto (nccl if CUDA)")
    init_method: str = setting("env://", "rendezvous URL: env://, tcp://host:port, file://path")
    timeout: float = setting(300.0, "seconds; bounds the rendezvous, init and every group")
    hang_timeout: float | None = setting(
        None, "seconds until a stuck collective is diagnosed; < timeout (null: timeout/2, <= 30 s before)"
    )
    debug: bool = setting(False, "every collective first checks its group agrees on op/dtype/shape")
    record: bool = setting(True, "record every collective for hang diagnosis (false: no watchdog)")


def structured_mirror(spec: type, name: str) -> type:
    """The plain dataclass ``spec`` as a structured config: the same fields, defaults and docs
    (``metadata["doc"]``), each type as OmegaConf holds it (``Sequence`` -> ``list``, ``Mapping`` ->
    ``dict``). A union OmegaConf cannot hold (``layout.trainers``: a list, a count or ranges) is
    ``Any`` here and checked where the value is used; ``--help`` names its first member, the
    canonical form (``metadata["type"]``), and the field's doc the others."""
    hints = typing.get_type_hints(spec)
    specs: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(spec):
        kind, shown = _omegaconf_type(hints[f.name])
        metadata = {**f.metadata, **({"type": shown} if shown else {})}
        if f.default_factory is not dataclasses.MISSING:
            copied = field(default_factory=f.default_factory, metadata=metadata)
        elif f.default is dataclasses.MISSING:
            copied = field(default=MISSING, metadata=metadata)  # required: "???"
        else:
            copied = field(default=f.default, metadata=metadata)
        specs.append((f.name, kind, copied))
    mirror = dataclasses.make_dataclass(name, specs)
    mirror.__module__ = __name__  # importable by name, so a pickled config finds it
    return mirror


def _omegaconf_type(hint: Any) -> tuple[Any, str | None]:
    """``hint`` as OmegaConf can type a field, and the name ``--help`` shows if not ``hint``'s."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) == 1 and len(args) == 2:
            inner, shown = _omegaconf_type(members[0])
            return (Any if inner is Any else inner | None), shown
        first, _ = _omegaconf_type(members[0])
        return Any, str(first).replace("typing.", "")
    if origin in (list, tuple, collections.abc.Sequence):
        return list[_omegaconf_type(args[0])[0]], None  # type: ignore[misc]
    if origin in (dict, collections.abc.Mapping):
        key, value = (_omegaconf_type(a)[0] for a in args)
        return dict[key, value], None  # type: ignore[valid-type]
    return hint, None


# The layout is declared once, by rlcomm's LayoutSpec (the planner's input); this is it as
# OmegaConf types it (mypy sees LayoutSpec itself).
if TYPE_CHECKING:
    LayoutConfig = LayoutSpec
else:
    LayoutConfig = structured_mirror(LayoutSpec, "LayoutConfig")


class Engine(str, Enum):
    """What starts the ranks of ``python -m app`` (app/launch/launcher.py)."""

    local = "local"  # torch's elastic agent, on this machine
    ray = "ray"  # one Ray actor per rank, on a Ray cluster (app/launch/ray_engine.py)


@dataclass
class RayConfig:
    """Where and how ``launcher.engine=ray`` places the ranks (docs/clusters.md, Ray)."""

    address: str | None = setting(
        None, "Ray cluster: null starts a local Ray for this run; auto the one `ray start` runs "
        "on this machine; or host:port of its head"
    )
    cpus_per_rank: float = setting(1.0, "CPUs each rank's actor reserves (>= 0)")
    gpus_per_rank: float = setting(0.0, "GPUs each rank's actor reserves (>= 0)")
    placement_timeout: float = setting(
        60.0, "seconds to wait for the ranks' placement groups before the run ends in one line"
    )
    max_rollouts: int | None = setting(
        None, "null: the planned rollout ranks only; N: the driver adds rollout actors beyond "
        "the plan, up to N rollout ranks in all, while the cluster has free CPUs for them"
    )


@dataclass
class LauncherConfig:
    """How the ranks are started: torch's elastic agent on this machine, or Ray actors."""

    engine: Engine = setting(Engine.local, "local (torch's elastic agent here) or ray (an actor "
                             "per rank on a Ray cluster: launcher.ray)")
    ray: RayConfig = setting(doc="launcher.engine=ray: cluster and resources", factory=RayConfig)
    max_restarts: int = setting(0, "restart every rank this many times after a failure")
    # torch's default: a finished run's exit is noticed within this.
    monitor_interval: float = setting(0.1, "seconds between the agent's health checks")
    shutdown_timeout: float = setting(5.0, "seconds from SIGTERM to SIGKILL for surviving ranks")
    rollout_restarts: int = setting(
        0, "restart a lost rollout rank (elastic layouts) this many times; it rejoins without "
        "restarting anyone"
    )
    trainer_restarts: int = setting(
        0, "restart a lost trainer (layout.elastic_trainers) this many times; it heals from a "
        "live trainer and rejoins without restarting anyone"
    )


@dataclass
class SweepConfig:
    """How a ``--multirun`` is summarised (app/hydra/sweep_summary.py, app/sweep/summary.py,
    app/sweep/report.py)."""

    rank_by: str | None = setting(
        None, "metric to rank sweep jobs by: one the loop declares (its `metrics`) or the app's "
        "startup_s, group_creation_s, wall_s; default: the loop's first headline one"
    )


@dataclass
class AppConfig:
    comm: CommConfig = setting(doc="backend, rendezvous and timeouts", factory=CommConfig)
    layout: LayoutConfig = setting(doc="ranks, roles and groups", factory=LayoutConfig)
    loop: Any = setting(MISSING, "the training loop: _target_ plus its settings")
    launcher: LauncherConfig = setting(doc="local launch", factory=LauncherConfig)
    sweep: SweepConfig = setting(doc="how a --multirun is ranked", factory=SweepConfig)
    seed: int = setting(
        0, "base seed; rank r seeds torch with seed + r and its environments with seed x 10000 + r"
    )
    plan_only: bool = setting(False, "print every rank's groups and exit; start nothing")
