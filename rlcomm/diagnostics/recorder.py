"""Flight recorder: every collective rlcomm runs, per mode, in a small bounded ring.

Always on and cheap (a slotted object, a frame walk and a deque append per call, about a
microsecond): when a collective hangs, the watchdog (:mod:`rlcomm.diagnostics.watchdog`) compares every
rank's record to say which rank never entered it, or entered something else. Sequence numbers
count this rank's recorded collectives per mode, so ranks that ran the same code agree on them.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from rlcomm.errors import HangError
from rlcomm.modes import Mode, mode_name

if TYPE_CHECKING:
    import torch
    from torch.distributed import Work

RING_SIZE = 64  # recent calls kept per mode
_RLCOMM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # rlcomm/
# How long a failing collective waits for a diagnosis the watchdog is still gathering.
_DIAGNOSIS_GRACE_S = 12.0  # the watchdog gathers answers for 10 s at most


_SRC_OPS = frozenset({"broadcast", "broadcast_object_list", "scatter"})  # peer is a src


# (call, its tensor, whether every rank must pass the same shape) -> None, raises on mismatch
Agreement = Callable[["Call", "torch.Tensor | None", bool], None]

def format_bytes(n: int) -> str:
    """``4 B``, ``3.1 MB``: sizes as a person reads them (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def format_call(call: dict[str, Any], with_seq: bool = True) -> str:
    """``broadcast #42 (src 0, float32[1024], 4.1 kB, ppo.py:211)`` from a call's record."""
    details = []
    if call.get("peer") is not None:
        details.append(f"{'src' if call['op'] in _SRC_OPS else 'dst'} {call['peer']}")
    if call.get("dtype"):
        shape = ",".join(map(str, call.get("shape") or ()))
        details.append(f"{call['dtype']}[{shape}]")
        details.append(format_bytes(int(call.get("nbytes", 0))))
    if call.get("site"):
        details.append(call["site"])
    seq = f" #{call['seq']}" if with_seq else ""
    return f"{call['op']}{seq} ({', '.join(details)})" if details else f"{call['op']}{seq}"


class Call:
    """One recorded collective; a context manager that marks it completed on a clean exit."""

    __slots__ = (
        "done",
        "dtype",
        "file",
        "line",
        "mode",
        "op",
        "peer",
        "recorder",
        "seq",
        "shape",
        "started",
        "works",
    )

    def __init__(  # one assignment per slot, nothing else: this runs on every collective
        self, recorder: FlightRecorder | None, mode: str, seq: int, op: str, dtype: Any,
        shape: tuple[int, ...], peer: int | None, file: str, line: int, started: float,
    ) -> None:
        self.recorder = recorder
        self.mode = mode
        self.seq = seq
        self.op = op
        self.dtype = dtype
        self.shape = shape
        self.peer = peer
        self.file = file
        self.line = line
        self.started = started  # time.monotonic()
        self.done = False
        self.works: list[Work] | None = None

    def __enter__(self) -> Call:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> Literal[False]:
        if exc is None:
            if self.works is None:  # an async launch completes when its works do
                self.done = True
            return False
        if self.recorder is not None and isinstance(exc, Exception):
            diagnosis = self.recorder.await_diagnosis()
            if diagnosis:
                raise HangError(diagnosis) from exc
        return False

    def pending(self, works: list[Work]) -> None:
        """An async launch: in flight until :meth:`finish` or until its works completed."""
        if self.recorder is not None:  # not the shared stand-in used while recording is off
            self.works = works

    def finish(self) -> None:
        if self.recorder is not None:
            self.done = True
            self.works = None

    def in_flight(self) -> bool:
        if self.done:
            return False
        works = self.works
        return works is None or not all(w.is_completed() for w in works)

    def record(self) -> dict[str, Any]:
        """Plain data, for reports and logs."""
        nbytes = 0
        dtype = ""
        if self.dtype is not None:
            dtype = str(self.dtype).removeprefix("torch.")
            numel = 1
            for dim in self.shape:
                numel *= dim
            nbytes = numel * self.dtype.itemsize
        return {
            "mode": self.mode,
            "seq": self.seq,
            "op": self.op,
            "dtype": dtype,
            "shape": list(self.shape),
            "nbytes": nbytes,
            "peer": self.peer,
            "site": f"{os.path.basename(self.file)}:{self.line}" if self.file else "",
            "path": f"{self.file}:{self.line}" if self.file else "",
            # Wall clock, comparable across ranks (and hosts with synchronised clocks).
            "started_wall": time.time() - (time.monotonic() - self.started),
            "in_flight": self.in_flight(),
        }


class _ModeLog:
    __slots__ = ("name", "ring", "seq")

    def __init__(self, name: str) -> None:
        self.name = name
        self.seq = 0
        self.ring: deque[Call] = deque(maxlen=RING_SIZE)


_OFF = Call(None, "", 0, "", None, (), None, "", 0, 0.0)  # returned while recording is off
_OFF.done = True


class FlightRecorder:
    """Per-mode rings of recorded collectives for one context.

    ``enabled`` switches recording (on by default); ``agree``, when set (``comm.debug``), runs
    before every collective: it makes the group agree on (op, dtype, shape) and raises at once on
    a mismatch naming both sides (:func:`rlcomm.diagnostics.agreement.agree_on_call`).
    """

    def __init__(self) -> None:
        self.enabled = True
        self.agree: Agreement | None = None
        self._modes: dict[str, _ModeLog] = {}
        self._diagnosis = ""
        self._diagnosing = threading.Event()  # the watchdog is gathering reports
        self._diagnosed = threading.Event()

    def call(
        self, mode: Mode, op: str, tensor: torch.Tensor | None = None, peer: int | None = None,
        same_shape: bool = True,
    ) -> Call:
        """Record the start of ``op`` on this rank's ``mode`` group; use as ``with``."""
        if not self.enabled:
            return _OFF
        log = self._modes.get(mode)  # a mode enum finds its name's entry (same hash, equal)
        if log is None:
            log = self._modes[mode_name(mode)] = _ModeLog(mode_name(mode))
        log.seq += 1
        frame = sys._getframe(1)  # the caller's file:line: first frame outside rlcomm
        while frame.f_back is not None and frame.f_code.co_filename.startswith(_RLCOMM_DIR):
            frame = frame.f_back
        call = Call(
            self, log.name, log.seq, op,
            None if tensor is None else tensor.dtype,
            () if tensor is None else tensor.shape,  # a torch.Size: an immutable tuple
            peer, frame.f_code.co_filename, frame.f_lineno, time.monotonic(),
        )
        log.ring.append(call)
        if self.agree is not None:  # recorded first: a hang in the agreement is this call's
            try:
                self.agree(call, tensor, same_shape)
            except BaseException:
                call.done = True  # it never started: no watchdog should wait for it
                raise
        return call

    # ---- what the watchdog reads ------------------------------------------------------------
    def in_flight(self) -> list[Call]:
        """Calls started and not completed, oldest first."""
        found = [c for log in list(self._modes.values()) for c in list(log.ring) if c.in_flight()]
        return sorted(found, key=lambda c: c.started)

    def table(self) -> dict[str, Any]:
        """Per mode: last sequence number entered and completed, and the recent calls."""
        out: dict[str, Any] = {}
        for mode, log in list(self._modes.items()):
            calls = list(log.ring)
            before = calls[0].seq - 1 if calls else 0  # older calls left the ring completed
            completed = max((c.seq for c in calls if not c.in_flight()), default=before)
            out[mode] = {
                "entered": log.seq,
                "completed": completed,
                "calls": [c.record() for c in calls[-8:]],
            }
        return out

    def format_table(self) -> str:
        """The table as log lines."""
        lines = []
        for mode, entry in sorted(self.table().items()):
            lines.append(f"  {mode}: entered #{entry['entered']}, completed #{entry['completed']}")
            for call in entry["calls"]:
                state = "IN FLIGHT" if call["in_flight"] else "done"
                lines.append(f"    {format_call({**call, 'site': call['path']})} {state}")
        return "\n".join(lines) or "  (no collective recorded)"

    # ---- the diagnosis, shared between the watchdog and the failing call --------------------
    def start_diagnosis(self) -> None:
        self._diagnosing.set()

    def set_diagnosis(self, text: str, diagnosing: bool = True) -> None:
        """Publish the watchdog's result (``diagnosing=False``: the hang resolved, forget it)."""
        self._diagnosis = text
        if diagnosing:
            self._diagnosed.set()
        else:
            self._diagnosing.clear()
            self._diagnosed.clear()

    @property
    def diagnosis(self) -> str:
        return self._diagnosis

    def await_diagnosis(self) -> str:
        """The hang diagnosis, waiting for it a little when the watchdog is still gathering."""
        if self._diagnosing.is_set():
            self._diagnosed.wait(_DIAGNOSIS_GRACE_S)
        return self._diagnosis
