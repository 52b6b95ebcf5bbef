"""Files a run writes off its critical path: the learning curve.

At its stop decision a run hands such work to :func:`in_background` and goes on with its
wind-down (the last checkpoint, the closing collectives, tearing down the groups), which mostly
waits on the network with the interpreter lock released. The rank waits for every job
(:func:`wait_for_background`, app/launch/rank.py) before it reports success, so every file exists
when ``result.json`` does, and a job's error (a full disk) fails the rank as if it had been
raised in line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_jobs: list[_Job] = []


class _Job(threading.Thread):
    def __init__(self, fn: Callable[..., object], args: tuple[object, ...], name: str) -> None:
        super().__init__(name=f"rlcomm-background-{name}", daemon=True)
        self.fn, self.args, self.what = fn, args, name
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.fn(*self.args)
        except BaseException as err:  # re-raised in the thread that waits
            self.error = err


def in_background(fn: Callable[..., object], *args: object, name: str = "") -> None:
    """Runs ``fn(*args)`` on a thread of its own from now on. ``name`` says what it writes
    (in the error of a job that does not finish in time)."""
    job = _Job(fn, args, name or getattr(fn, "__qualname__", "job"))
    job.start()
    _jobs.append(job)


def pending() -> list[str]:
    """What is still being written."""
    return [job.what for job in _jobs if job.is_alive()]


def wait_for_background(timeout_s: float | None = None) -> None:
    """Waits for every job handed off so far, then re-raises the first error one of them
    raised. A job still running after ``timeout_s`` (in total) raises TimeoutError naming it."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        for job in list(_jobs):
            job.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if job.is_alive():
                raise TimeoutError(f"{job.what} still being written after {timeout_s:g} s")
        for job in _jobs:
            if job.error is not None:
                raise job.error
    finally:
        _jobs[:] = [job for job in _jobs if job.is_alive()]
