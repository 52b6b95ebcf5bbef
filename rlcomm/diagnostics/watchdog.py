"""Watchdog: a thread per rank that notices a collective that does not complete, asks every rank
for its progress over the rendezvous store (a side channel that does not depend on the stuck
group), and turns the answers into one line (:func:`rlcomm.diagnostics.diagnosis.diagnose`).

Gloo and NCCL block in C++ with the GIL released, so this thread runs while the main thread
waits. It fires ``hang_timeout`` seconds after a collective started, before the group's own
timeout ends it, so the failing call raises :class:`~rlcomm.errors.HangError` with the diagnosis
instead of the backend's bare "timed out". Every rank, stuck or not (a rank in user code too),
answers a request by writing its collective table and every thread's Python stack to its log.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlcomm.diagnostics.diagnosis import diagnose

if TYPE_CHECKING:
    from torch.distributed import Store

    from rlcomm.diagnostics.recorder import Call, FlightRecorder

log = logging.getLogger("rlcomm.hang")

POLL_S = 0.5  # how often the thread looks at its own calls and at the store (small worlds)
_POLLS_PER_S_MAX = 512  # store requests per second of all ranks together, for large worlds
_EPOCH_KEY = "hang/epoch"


def default_hang_timeout(timeout_s: float) -> float:
    """When to diagnose, given the groups' timeout: early enough that every rank can answer
    before the backend gives up (half the timeout, at most 30 s before it)."""
    return timeout_s - min(timeout_s / 2, 30.0)


def timeout_problem(timeout: Any, hang_timeout: Any, prefix: str = "") -> str | None:
    """What is wrong with a (timeout, hang_timeout) pair, or None: the one home of the rule.

    ``prefix`` names where the values came from (``"comm."`` for the app's config), so the
    message reads ``comm.timeout: must be ...``; without it, ``timeout must be ...``.
    """
    sep = ": " if prefix else " "
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        return f"{prefix}timeout{sep}must be a positive number of seconds, got {timeout!r}"
    if hang_timeout is not None and not 0 < hang_timeout < timeout:
        return (
            f"{prefix}hang_timeout{sep}must be > 0 and < {prefix}timeout ({timeout:g}), "
            f"got {hang_timeout!r}"
        )
    return None


def main_thread_site() -> str:
    """``loops.py:17 in __call__``: the innermost Python frame of the main thread."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def format_stacks() -> str:
    """Every thread's Python stack, as a traceback reads."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


class Watchdog:
    """The hang watchdog of one rank (started by ``CommContext.init_distributed_env``).

    It reads ``recorder`` for calls in flight, and ``groups()`` (mode -> declared ranks) for the
    report it shares with the other ranks through ``store``.
    """

    def __init__(
        self,
        recorder: FlightRecorder,
        groups: Callable[[], dict[str, list[int]]],
        store: Store,
        rank: int,
        world_size: int,
        hang_timeout: float,
        timeout: float,
    ) -> None:
        self._recorder = recorder
        self._groups = groups
        self._store = store
        self.hang_timeout = hang_timeout
        self._rank = rank
        self._world = world_size
        # One tiny store request per poll and rank: large worlds poll less often (5 s at most).
        self._poll_s = min(5.0, max(POLL_S, self._world / _POLLS_PER_S_MAX))
        # Answers are awaited until the groups' own timeout at most (a call that fails meanwhile
        # waits for the diagnosis: see FlightRecorder.await_diagnosis).
        self._gather_s = max(2.0 + self._poll_s, min(10.0, timeout - hang_timeout))
        self._answered = 0  # the last request epoch this rank answered
        self._answered_at = 0.0
        self._fired: list[Call] = []  # calls this rank raised a request for, still in flight
        self._pending: tuple[int, float] | None = None  # (epoch, give up at) being gathered
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._dump_signals: set[int] = set()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlcomm-watchdog", daemon=True)
        self._thread.start()
        # Joined before the interpreter exits: a daemon thread caught inside a C++ store call
        # while the process tears down torch can abort it.
        atexit.register(self.stop)

    # ---- public -----------------------------------------------------------------------------
    def dump_on(self, signum: int = signal.SIGUSR1) -> None:
        """Make ``signum`` write this rank's collective table and stacks to its log, without
        stopping it, even while the main thread is blocked in a collective (call it from the
        main thread)."""
        self._dump_signals.add(signum)
        signal.signal(signum, lambda *_: None)  # installs the C handler; the work is below
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

    def dump(self, reason: str) -> None:
        """Write this rank's collective table and every thread's stack to the log."""
        recorder = self._recorder
        log.warning(
            "rank %d: %s\ncollectives of rank %d:\n%s\nPython stacks of rank %d:\n%s",
            self._rank, reason, self._rank, recorder.format_table(), self._rank, format_stacks(),
        )

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self._stopped.is_set():
            return
        self._stopped.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        if threading.current_thread() is not self._thread:
            self._thread.join(5)
        with contextlib.suppress(ValueError):  # ValueError: not the main thread
            previous = signal.set_wakeup_fd(-1)
            if previous not in (-1, self._wake_w):  # someone else's: put it back
                signal.set_wakeup_fd(previous)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ---- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            ready, _, _ = select.select([self._wake_r], [], [], self._poll_s)
            if self._stopped.is_set():
                return
            if ready:
                with contextlib.suppress(OSError):
                    # Python writes the number of every signal it handles; a stop writes 0.
                    received = set(os.read(self._wake_r, 64)) & self._dump_signals
                    for signum in received:
                        self.dump(f"stacks on demand ({signal.Signals(signum).name})")
            try:
                self._tick()
            except Exception:  # the store went away (run ending): nothing left to diagnose
                if not self._stopped.is_set():
                    log.debug("watchdog tick failed", exc_info=True)

    def _tick(self) -> None:
        epoch = int(self._store.add(_EPOCH_KEY, 0))
        if epoch > self._answered:
            self._answer(epoch, "another rank asked: a collective does not complete")
        now = time.monotonic()
        for call in self._recorder.in_flight():
            if now - call.started < self.hang_timeout or any(c is call for c in self._fired):
                continue
            self._fired.append(call)
            self._request(call)
            break
        if self._pending is not None:
            self._try_diagnose()
        elif self._fired:
            self._fired = [c for c in self._fired if c.in_flight()]
            if not self._fired:  # it completed after all (a slow rank): forget the diagnosis
                self._recorder.set_diagnosis("", diagnosing=False)

    def _request(self, call: Call) -> None:
        """Ask every rank for its progress (unless a request newer than this call is out)."""
        self._recorder.start_diagnosis()
        epoch = self._answered
        if self._answered_at < call.started:
            epoch = int(self._store.add(_EPOCH_KEY, 1))
        self._answer(
            epoch, f"{call.mode} {call.op} #{call.seq} has not completed in {self.hang_timeout:g}s"
        )
        self._pending = (epoch, time.monotonic() + self._gather_s)

    def _answer(self, epoch: int, reason: str) -> None:
        report = json.dumps(self._report())
        for missed in range(self._answered + 1, epoch + 1):  # one answer per request it missed
            self._store.set(f"hang/{missed}/report/{self._rank}", report)
        self._answered, self._answered_at = epoch, time.monotonic()
        self.dump(reason)

    def _report(self) -> dict[str, Any]:
        return {
            "rank": self._rank,
            "groups": self._groups(),
            "modes": self._recorder.table(),
            "where": main_thread_site(),
        }

    def _try_diagnose(self) -> None:
        assert self._pending is not None
        epoch, give_up_at = self._pending
        keys = [f"hang/{epoch}/report/{r}" for r in range(self._world)]
        if not self._store.check(keys) and time.monotonic() < give_up_at:
            return
        self._pending = None
        arrived = [k for k in keys if self._store.check([k])]
        reports: dict[int, Any] = {r: None for r in range(self._world)}
        for key in arrived:
            report = json.loads(self._store.get(key))
            reports[int(report["rank"])] = report
        text = diagnose(reports)
        if text:
            log.error("rank %d: %s", self._rank, text)
        self._recorder.set_diagnosis(text)
