"""What every part of the hand-off shares: the settings it is given (:class:`HandOffSettings`),
what a round brings (:class:`Round`), what it measures (:class:`HandOffStats`) and the staleness
check every trainer applies to the segments it is handed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from app.runtime.core.algorithm import Segment
from app.runtime.rollout.worker import Episode


@dataclass
class Round:
    """What one update's hand-off brings a rank: the segments it trains on (trainers), the
    finished episodes it learns (every episode of the job, on ranks that take the stop
    decision) and the figures of the update's row (``segments``: how many the job collected;
    ``staleness``, the waits, and on elastic runs ``members`` and ``epoch``). ``stop_asked``: a
    rank of a static layout was asked to stop (SIGTERM: app/runtime/core/stopping.py), so every
    rank stops after this update."""

    segments: list[Segment] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    shared: dict[str, float] = field(default_factory=dict)
    stop_asked: bool = False


@dataclass(frozen=True)
class HandOffSettings:
    """What every hand-off is told by the run's settings (``loop.*``)."""

    max_staleness: int
    verify_every: int  # loop.verify_weights_every
    min_rollouts: int
    timeout_s: float  # comm.timeout
    episode_cap: int  # finished episodes one rank shares per update, at most
    sharded: bool  # the trainers are sharded (TrainedModule.sharded)
    # How often a lost rollout rank is started again (JobInfo.rollout_restarts); None: one may
    # be started by hand at any time.
    rollout_restarts: int | None = None


@dataclass(frozen=True)
class ReplayHooks:
    """Where replay ranks (``layout.replay``) meet the hand-off, as app/runtime/replay/service.py's
    ReplayLink provides them: a collector's ``write`` of its packed segment to its replay rank
    (returning what the hand-off still carries of it), and a replay rank's ``served``, which
    returns once its server has served the run. None: this rank has no such part."""

    write: Callable[[Tensor], Tensor] | None = None
    served: Callable[[], None] | None = None


@dataclass
class HandOffStats:
    """One rank's measures of the hand-off, for its result.json entry; every part adds to it."""

    transfer_s: float = 0.0  # trainers: seconds spent sending weights
    wait_s: float = 0.0  # this update's seconds blocked on the other side of the hand-off
    wait_total_s: float = 0.0  # every update's
    # Payload this rank sent to other ranks (weights by a trainer, trajectories by a rollout
    # rank), so a run can be checked against what the network carried.
    weight_bytes_sent: int = 0
    trajectory_bytes_sent: int = 0
    staleness: dict[int, int] = field(default_factory=dict)  # version lag -> segments trained on

    def close_wait(self) -> float:
        """This update's waiting time, now counted in the total."""
        wait, self.wait_s = self.wait_s, 0.0
        self.wait_total_s += wait
        return wait

    def trained(self, lags: list[int]) -> None:
        """Segments of these version lags are trained on."""
        for lag in lags:
            self.staleness[lag] = self.staleness.get(lag, 0) + 1


class StaleDataError(RuntimeError):
    """A trainer was handed a segment older than ``loop.max_staleness`` allows."""


def check_staleness(
    versions: list[tuple[int, int]], current: int, max_staleness: int, update: int
) -> list[int]:
    """Each segment's version lag behind ``current`` (the weights about to be trained) from its
    ``(rank, version)``; a lag beyond ``max_staleness`` (or a version from the future) raises,
    so such data is never trained on."""
    lags = [current - version for _, version in versions]
    for (rank, version), lag in zip(versions, lags):
        if not 0 <= lag <= max_staleness:
            raise StaleDataError(
                f"update {update}: rank {rank}'s segment was collected with weights version "
                f"{version}, {lag} behind version {current} (loop.max_staleness={max_staleness})"
            )
    return lags
