"""Checkpoints written off the update loop: the trainer takes a snapshot (copies it no longer
touches) and a thread of its own writes it, checksums it, syncs it and renames it into place,
while training goes on.

At most one write is in flight: a checkpoint due while the previous one is still being written
waits for it, and the wait is counted (``waited_s``, in result.json). A write that failed is
raised in the training thread at its next check (:meth:`BackgroundWrites.check`, every update),
as a write in line would have raised it: the run ends with the same one line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BackgroundWrites:
    """One process's checkpoint writes, one at a time, each on a thread of its own."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.writes = 0
        self.waits = 0  # writes that found the previous one still in flight
        self.waited_s = 0.0  # how long the update loop waited for them
        self.write_s = 0.0  # seconds the writes took, in their thread

    def settle(self) -> None:
        """Waits for the write in flight, if any (counted), and raises a failed one's error."""
        if self.busy:
            tick = time.perf_counter()
            self.wait()
            self.waits += 1
            self.waited_s += time.perf_counter() - tick
        self.check()

    def submit(self, write: Callable[[], object], name: str) -> None:
        """Runs ``write`` on a thread of its own, once the previous write is done."""
        self.settle()
        self._thread = threading.Thread(target=self._run, args=(write,), daemon=True,
                                        name=f"rlcomm-checkpoint-{name}")
        self.writes += 1
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the write in flight is done; re-raises its error. One still running after
        ``timeout_s`` raises TimeoutError."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"a checkpoint still being written after {timeout_s:g} s")
        self.check()

    def check(self) -> None:
        """Re-raises the error of a write that failed (once)."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self, write: Callable[[], object]) -> None:
        tick = time.perf_counter()
        try:
            write()
        except BaseException as err:  # re-raised in the training thread (check)
            self._error = err
        finally:
            self.write_s += time.perf_counter() - tick

    def figures(self) -> dict[str, float]:
        """What the writes cost the update loop, for result.json."""
        return {"checkpoints_written": self.writes, "checkpoint_waits": self.waits,
                "checkpoint_wait_s": round(self.waited_s, 4),
                "checkpoint_write_s": round(self.write_s, 3)}
