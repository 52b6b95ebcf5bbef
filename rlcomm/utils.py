"""Small process-level helpers shared by the context and the initializers."""

from __future__ import annotations

import os
import threading
from typing import Any, ClassVar

from .errors import EnvironmentConfigError


class SingletonMeta(type):
    """One instance per class per process; ``reset_instance`` forgets it (used by ``destroy``)."""

    _instances: ClassVar[dict[type, Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        with SingletonMeta._lock:
            if cls not in SingletonMeta._instances:
                SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
            return SingletonMeta._instances[cls]

    def reset_instance(cls) -> None:
        with SingletonMeta._lock:
            SingletonMeta._instances.pop(cls, None)


def env_int(name: str, default: int | None = None) -> int:
    """An integer environment variable; a missing or malformed one is an error naming it."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is not None:
            return default
        raise EnvironmentConfigError(f"environment variable {name} is not set")
    try:
        return int(raw)
    except ValueError:
        raise EnvironmentConfigError(
            f"environment variable {name}={raw!r} is not an integer"
        ) from None


def format_ranks(ranks: list[int] | tuple[int, ...], limit: int = 8) -> str:
    """``[0,2]`` for short lists, ``[0,1,2,...,4095](4096)`` for long ones (logs stay readable)."""
    if len(ranks) <= limit:
        return "[" + ",".join(map(str, ranks)) + "]"
    head = ",".join(map(str, ranks[: limit - 1]))
    return f"[{head},...,{ranks[-1]}]({len(ranks)})"
