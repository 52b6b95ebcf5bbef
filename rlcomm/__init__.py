"""rlcomm: torch.distributed process groups per parallel mode for distributed RL training.

Torch-free parts (modes, errors, layout planning) import instantly; the rest loads on first use,
so that planning a layout does not pay for ``import torch``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rlcomm.plan.layout import (
    GroupSpec,
    LayoutPlan,
    LayoutSpec,
    format_plan,
    grid_groups,
    plan_layout,
)

from .backends import Backend, resolve_backend
from .errors import (
    BackendError,
    EnvironmentConfigError,
    GroupRegistrationError,
    JoinTimeoutError,
    LayoutError,
    ModeNotRegisteredError,
    RlcommError,
)
from .modes import CommMode, ParallelMode, mode_name

_LAZY = {
    "CommContext": "context",
    "GroupInfo": "registry",
    "GroupInitializer": "group_initializer",
    "register_initializer": "group_initializer",
    "collectives": "collectives",
    "WeightSender": "weights",
    "WeightReceiver": "weights",
}

__all__ = [
    "Backend",
    "BackendError",
    "CommMode",
    "EnvironmentConfigError",
    "GroupRegistrationError",
    "GroupSpec",
    "JoinTimeoutError",
    "LayoutError",
    "LayoutPlan",
    "LayoutSpec",
    "ModeNotRegisteredError",
    "ParallelMode",
    "RlcommError",
    "format_plan",
    "grid_groups",
    "mode_name",
    "plan_layout",
    "resolve_backend",
    *_LAZY,
]

if TYPE_CHECKING:
    from . import collectives
    from .context import CommContext
    from .group_initializer import GroupInitializer, register_initializer
    from .registry import GroupInfo
    from .weights import WeightReceiver, WeightSender


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'rlcomm' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name]}", __name__)
    return module if name == _LAZY[name] else getattr(module, name)
