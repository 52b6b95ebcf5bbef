"""Structured config schemas, registered in Hydra's ConfigStore.

Plain dataclasses: OmegaConf type-checks every override against them (``comm.timeout=abc`` is
rejected by Hydra before anything starts); rlcomm's planner validates what types cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class Backend(str, Enum):
    gloo = "gloo"
    nccl = "nccl"
    auto = "auto"


@dataclass
class CommConfig:
    backend: Backend = Backend.gloo
    init_method: str = "env://"  # the seed's dist_url
    timeout: float = 300.0  # seconds; for the rendezvous, init and every group


@dataclass
class LayoutConfig:
    world_size: int = MISSING
    ranks_per_node: int | None = None  # default: everything on one node
    nodes: int | None = None
    trainers: list[int] = field(default_factory=list)
    rollouts: list[int] = field(default_factory=list)
    groups: dict[str, list[list[int]]] = field(default_factory=dict)
    tensor_parallel_size: int | None = None
    sequence_parallel_size: int | None = None
    data_parallel_size: int | None = None


@dataclass
class LauncherConfig:
    """How local ranks are started (torch's elastic agent)."""

    max_restarts: int = 0  # restart every rank this many times after a failure
    monitor_interval: float = 0.2  # seconds between the agent's health checks
    shutdown_timeout: float = 5.0  # SIGTERM -> SIGKILL grace for surviving ranks


@dataclass
class SweepConfig:
    """How a ``--multirun`` is summarised (app/callbacks.py, app/sweep_report.py)."""

    rank_by: str | None = None  # a metric of app/metrics.py; default: the loop's headline metric


@dataclass
class AppConfig:
    comm: CommConfig = field(default_factory=CommConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    loop: Any = MISSING  # a node with _target_, built by hydra.utils.instantiate
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    seed: int = 0
    plan_only: bool = False


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="app_schema", node=AppConfig)
    cs.store(group="comm", name="comm_schema", node=CommConfig)
    cs.store(group="layout", name="layout_schema", node=LayoutConfig)
