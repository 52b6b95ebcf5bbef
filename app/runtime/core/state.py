"""Where one rank's run stands: what every role reads and the run loop advances."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from app.runtime.core.data import Episode

# Finished episodes a rank keeps in memory (and a checkpoint holds) at least: the stop rule reads
# the last ``loop.window`` of them, and a resume may widen the window up to this many without
# waiting for new ones. Every episode of the run is in ``episodes.csv`` (app/runtime/records/).
KEPT_EPISODES = 100


def recent_deque(window: int, episodes: Iterable[Episode] = ()) -> deque[Episode]:
    """The last ``max(window, KEPT_EPISODES)`` of ``episodes``, as a :class:`RunState` keeps them."""
    return deque(episodes, maxlen=max(window, KEPT_EPISODES))


@dataclass
class RunState:
    """The updates done, the job's env steps, how many episodes finished (``episodes_done``)
    and the last of them (``recent``, bounded: :data:`KEPT_EPISODES`, or the window if larger);
    a resumed run starts from its checkpoint's. ``epoch_base``: a resumed elastic run's
    membership epochs count on from its checkpoint's; ``epoch``: the membership epoch of the
    last update (elastic runs; counted on over attempts). ``reached_at``: when (seconds trained)
    and at how many env steps the target was first reached; ``train_s_before``: seconds trained
    by this run's earlier attempts, up to the checkpoint this one resumed from;
    ``resumed_from``: that checkpoint (its run's trackers go on: app/output/trackers/)."""

    update: int = 0
    env_steps: int = 0
    recent: deque[Episode] = field(default_factory=lambda: recent_deque(0))
    episodes_done: int = 0
    epoch_base: int = 0
    epoch: int | None = None
    reached_at: tuple[float, int] | None = None
    train_s_before: float = 0.0
    resumed_from: Path | None = None
    attempt_start: float = field(default_factory=time.perf_counter)

    @classmethod
    def for_window(cls, window: int) -> RunState:
        """A fresh state that keeps enough episodes for a stop rule over ``window``."""
        return cls(recent=recent_deque(window))

    def learn(self, episodes: list[Episode]) -> None:
        """Episodes that finished in this update, in the job's order."""
        self.recent.extend(episodes)
        self.episodes_done += len(episodes)

    def restore_episodes(self, recent: Iterable[Episode], done: int) -> None:
        """A checkpoint's last episodes and count (``done``: every episode of the run so far)."""
        self.recent = recent_deque(self.recent.maxlen or 0, recent)
        self.episodes_done = done

    def training_s(self) -> float:
        """Seconds trained so far, over every attempt of this run."""
        return self.train_s_before + time.perf_counter() - self.attempt_start

    def recent_return(self, window: int) -> float:
        """The stop rule's quantity: the mean return of the last ``window`` episodes (-inf
        until that many finished)."""
        if len(self.recent) < window:
            return float("-inf")
        returns = [r for r, _ in list(self.recent)[-window:]]
        return float(np.mean(returns))
