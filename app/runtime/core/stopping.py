"""A stop asked of a rank from outside: SIGTERM (a batch system preempting the job, ``kill``,
the launcher stopping its ranks).

A rank does not die where the signal finds it, mid-update: it notes the request (:func:`listen`),
the deciding ranks agree on it at the end of the update (the hand-off's episodes on a static
layout, the trainers' records otherwise), and the run stops there as it would at its budget,
with a checkpoint (docs/data-safety.md, "Stopping with a checkpoint"); a rank that follows its
trainer is stopped by it. A rank that has not reached that stop ``grace_s`` seconds after the
signal (a peer is gone, so the update cannot end) ends as SIGTERM would have ended it, and so
does one whose run fails once it was asked: to the launcher it was stopped, not a cause. A
rollout rank whose trainer is gone does not wait for the grace: it ends at once
(app/runtime/membership/rollouts.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

_asked: list[int] = []
_grace_s: list[float] = []
_timers: list[threading.Timer] = []  # the grace of the stop asked, while it runs


def asked() -> bool:
    """Whether this process was asked to stop."""
    return bool(_asked)


def reason() -> str | None:
    """The signal that asked, by name (``SIGTERM``), or None."""
    return signal.Signals(_asked[0]).name if _asked else None


def listen(grace_s: float) -> Callable[[], None]:
    """Notes SIGTERM instead of dying of it at once (main thread only; elsewhere nothing
    changes); returns what puts the previous handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _asked.clear()
    _grace_s[:] = [grace_s]
    previous = signal.signal(signal.SIGTERM, _note)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def reached() -> None:
    """The run stopped where the ranks agreed: it winds down as at any end (its last
    checkpoint, its reports), no longer bound by the grace."""
    for timer in _timers:
        timer.cancel()
    _timers.clear()


def die() -> None:
    """Ends this process as SIGTERM's default action does (exit status -SIGTERM), from any
    thread, even while the main thread waits in a collective (Python's handler would run only
    once it returns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGTERM, None)  # SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)


def _note(signum: int, frame: FrameType | None) -> None:
    if _asked:  # the second time: at once
        die()
        return
    _asked.append(signum)
    grace = _grace_s[0] if _grace_s else 0.0
    timer = threading.Timer(grace, die)
    timer.daemon = True
    timer.name = "rlcomm-stop-grace"
    _timers.append(timer)
    timer.start()
