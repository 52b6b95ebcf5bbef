"""Structured config: the schemas, their ConfigStore entries and ``--help``."""

from app.api import setting
from app.config.registry import build_loop, loop_schema, register_configs, register_loop
from app.config.schema import AppConfig, CommConfig, LauncherConfig, LayoutConfig, SweepConfig

__all__ = [
    "AppConfig",
    "CommConfig",
    "LauncherConfig",
    "LayoutConfig",
    "SweepConfig",
    "build_loop",
    "loop_schema",
    "register_configs",
    "register_loop",
    "setting",
]
