"""Where one rank's run stands: what every role reads and the run loop advances."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.runtime.worker import Episode


@dataclass
class RunState:
    """The updates done, the job's env steps and every finished episode this rank learnt; a
    resumed run starts from its checkpoint's. ``epoch_base``: a resumed elastic run's
    membership epochs count on from its checkpoint's. ``reached_at``: when (seconds trained)
    and at how many env steps the target was first reached; ``train_s_before``: seconds trained
    by this run's earlier attempts, up to the checkpoint this one resumed from;
    ``resumed_from``: that checkpoint (its run's trackers go on: app/output/trackers/)."""

    update: int = 0
    env_steps: int = 0
    episodes: list[Episode] = field(default_factory=list)
    epoch_base: int = 0
    reached_at: tuple[float, int] | None = None
    train_s_before: float = 0.0
    resumed_from: Path | None = None
    attempt_start: float = field(default_factory=time.perf_counter)

    def training_s(self) -> float:
        """Seconds trained so far, over every attempt of this run."""
        return self.train_s_before + time.perf_counter() - self.attempt_start

    def recent_return(self, window: int) -> float:
        """The stop rule's quantity: the mean return of the last ``window`` episodes (-inf
        until that many finished)."""
        recent = self.episodes[-window:]
        if len(recent) < window:
            return float("-inf")
        return float(np.mean([r for r, _ in recent]))
