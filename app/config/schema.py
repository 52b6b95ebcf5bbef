"""Structured config schemas, registered in Hydra's ConfigStore.

Plain dataclasses whose fields carry a one-line doc (``setting(default, "doc")``, shown by
``python -m app --help``): OmegaConf type-checks every override against them and rejects unknown
keys (``comm.timeout=abc``, ``loop.hparams.num_envs=abc``, ``loop.nosuch=1``) before anything
starts; ``app.launch.planning.validate`` range-checks what types cannot. A loop is a dataclass too and is
its own schema (:func:`loop_schema`); shipped loops are registered as ``loop/<name>_schema``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from app.api import setting
from rlcomm import Backend


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


@dataclass
class LayoutConfig:
    world_size: int = setting(MISSING, "number of ranks")
    ranks_per_node: int | None = setting(None, "ranks per node (null: all on one node)")
    nodes: int | None = setting(None, "number of nodes (checked against ranks_per_node)")
    trainers: list[int] = setting(doc="ranks that train (DDP over TRAIN_DATA_PARALLEL)", factory=list)
    rollouts: list[int] = setting(doc="ranks that step environments (none: colocated)", factory=list)
    groups: dict[str, list[list[int]]] = setting(
        doc="explicit rank lists per mode; override what is derived", factory=dict
    )
    tensor_parallel_size: int | None = setting(None, "TENSOR_PARALLEL group size (Megatron grid)")
    sequence_parallel_size: int | None = setting(None, "SEQUENCE_PARALLEL group size")
    data_parallel_size: int | None = setting(None, "DATA_PARALLEL size (checked against the grid)")


@dataclass
class LauncherConfig:
    """How local ranks are started (torch's elastic agent)."""

    max_restarts: int = setting(0, "restart every rank this many times after a failure")
    monitor_interval: float = setting(0.2, "seconds between the agent's health checks")
    shutdown_timeout: float = setting(5.0, "seconds from SIGTERM to SIGKILL for surviving ranks")


@dataclass
class SweepConfig:
    """How a ``--multirun`` is summarised (app/sweep/callbacks.py, app/sweep/report.py)."""

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
    seed: int = setting(0, "base seed; rank r uses seed + r")
    plan_only: bool = setting(False, "print every rank's groups and exit; start nothing")
