"""Small process-level helpers shared by the context and the initializers."""

from __future__ import annotations

import threading
from typing import Any, ClassVar


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


def format_ranks(ranks: list[int] | tuple[int, ...], limit: int = 8) -> str:
    """``[0,2]`` for short lists, ``[0,1,2,...,4095](4096)`` for long ones (logs stay readable)."""
    if len(ranks) <= limit:
        return "[" + ",".join(map(str, ranks)) + "]"
    head = ",".join(map(str, ranks[: limit - 1]))
    return f"[{head},...,{ranks[-1]}]({len(ranks)})"
