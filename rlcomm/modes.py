"""Names of the communication groups a rank can belong to.

Values are plain strings, so a mode works as a YAML key, as an OmegaConf enum field and as a
dictionary key interchangeably: ``ParallelMode.INTRA_NODE == CommMode.INTRA_NODE == "INTRA_NODE"``.
The registry is keyed by that string, so both enums address the same group.
"""

from __future__ import annotations

from enum import Enum


class _StrMode(str, Enum):
    def __str__(self) -> str:
        return str(self.value)

    # str.__hash__, so that a mode and its plain-string name are one dictionary key.
    __hash__ = str.__hash__


class CommMode(_StrMode):
    """Groups that follow from the machine: everyone, one node, one rank per node."""

    GLOBAL = "GLOBAL"
    INTRA_NODE = "INTRA_NODE"
    INTER_NODE = "INTER_NODE"


class ParallelMode(_StrMode):
    """Every group the layout can declare: CommMode's plus the training/RL ones."""

    GLOBAL = "GLOBAL"
    INTRA_NODE = "INTRA_NODE"
    INTER_NODE = "INTER_NODE"
    TRAIN_DATA_PARALLEL = "TRAIN_DATA_PARALLEL"
    DATA_PARALLEL = "DATA_PARALLEL"
    TENSOR_PARALLEL = "TENSOR_PARALLEL"
    SEQUENCE_PARALLEL = "SEQUENCE_PARALLEL"
    WEIGHT_TRANSFER = "WEIGHT_TRANSFER"
    REPLAY = "REPLAY"


Mode = str | CommMode | ParallelMode

_user_modes: set[str] = set()
_BUILT_IN = frozenset(m.value for m in ParallelMode)


def mode_name(mode: Mode) -> str:
    """The registry key of a mode: its plain string name."""
    return str(mode.value) if isinstance(mode, Enum) else str(mode)


def register_mode_name(name: str) -> None:
    """Make ``name`` a valid mode for layouts (``register_initializer`` calls this)."""
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"mode name must be a non-empty identifier, got {name!r}")
    _user_modes.add(name)


def known_mode_names() -> list[str]:
    return [m.value for m in ParallelMode] + sorted(_user_modes)


def is_known_mode(name: str) -> bool:
    return name in _BUILT_IN or name in _user_modes
