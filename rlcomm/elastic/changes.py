"""What a membership records of its changes: every join and leave, with when and why."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Change:
    """A join or a leave of ``rank`` (on ``host``, for ``reason``) in ``epoch``, at the leader's
    step ``step`` (its users' unit: an update). ``settled_s``: for a leave, seconds from it to
    the leader's next step done without the member (its users note it); ``details``: what its
    users add (each one's own figures, recorded as they are)."""

    event: str  # "join" | "leave"
    rank: int
    host: str
    reason: str
    epoch: int
    step: int
    time: float = field(default_factory=time.time)
    settled_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """As result.json keeps it (``update``: the step)."""
        record: dict[str, Any] = {"event": self.event, "rank": self.rank, "host": self.host,
                                  "reason": self.reason, "epoch": self.epoch,
                                  "update": self.step, "time": round(self.time, 3)}
        if self.event == "leave":
            record["next_update_s"] = _rounded(self.settled_s)
        return {**record, **{k: _rounded(v) if isinstance(v, float) else v
                             for k, v in self.details.items()}}


class Changes(list[Change]):
    """A leader's changes, in order."""

    def note(self, event: str, rank: int, host: str, reason: str, epoch: int,
             step: int) -> Change:
        change = Change(event, rank, host, reason, epoch, step)
        self.append(change)
        return change

    def settled(self, now: float | None = None) -> None:
        """The leader made a step: the leaves not yet settled are, now."""
        now = time.time() if now is None else now
        for change in self:
            if change.event == "leave" and change.settled_s is None:
                change.settled_s = now - change.time

    def records(self) -> list[dict[str, Any]]:
        return [change.record() for change in self]

    def lost(self) -> str:
        """The leaves, named: ``rank 3 on host (killed), ...`` (empty: none)."""
        return ", ".join(f"rank {c.rank} on {c.host} ({c.reason})"
                         for c in self if c.event == "leave")


def _rounded(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None
