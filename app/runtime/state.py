"""Where one rank's run stands: what every role reads and the run loop advances."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from app.runtime.worker import Episode


@dataclass
class RunState:
    """The updates done, the job's env steps and every finished episode this rank learnt; a
    resumed run starts from its checkpoint's. ``epoch_base``: a resumed elastic run's
    membership epochs count on from its checkpoint's."""

    update: int = 0
    env_steps: int = 0
    episodes: list[Episode] = field(default_factory=list)
    epoch_base: int = 0

    def recent_return(self, window: int) -> float:
        """The stop rule's quantity: the mean return of the last ``window`` episodes (-inf
        until that many finished)."""
        recent = self.episodes[-window:]
        if len(recent) < window:
            return float("-inf")
        return float(np.mean([r for r, _ in recent]))
