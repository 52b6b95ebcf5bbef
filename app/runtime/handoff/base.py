"""The hand-off's contract: :class:`HandOff`, what a round brings (:class:`Round`) and the
settings every implementation is given (:class:`HandOffSettings`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from app.runtime.algorithm import Segment
from app.runtime.worker import Episode


@dataclass
class Round:
    """What one update's hand-off brings a rank: the segments it trains on (trainers), the
    finished episodes it learns (every episode of the job, on ranks that take the stop
    decision) and the figures of the update's row (``segments``: how many the job collected;
    ``staleness``, the waits, and on elastic runs ``members`` and ``epoch``)."""

    segments: list[Segment] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    shared: dict[str, float] = field(default_factory=dict)


class HandOff(Protocol):
    """One rank's side of the trainer <-> rollout hand-off.

    Per update, every rank calls :meth:`exchange` once and then (unless the run stops)
    :meth:`sync_weights` once; a trainer calls :meth:`before_optimizer_step` before it changes
    the weights being sent and :meth:`update_done` after the update; :meth:`stop` once after
    the last update.
    """

    kind: str  # "flat", "sharded", "elastic" or "elastic-sharded": the plan's choice (result.json)
    transfer_s: float  # trainers: seconds spent sending weights
    wait_total_s: float  # seconds blocked on the other side of the hand-off
    weight_bytes_sent: int
    trajectory_bytes_sent: int
    staleness: dict[int, int]  # version lag -> segments trained on (trainers)
    on_wait: Callable[[str], None] | None  # told when the run waits for rollout ranks

    def version(self, updates: int) -> int:
        """The weights version this rank acts with (rollouts) or trains (trainers)."""
        ...

    def sync_weights(self, first: bool) -> bool:
        """Trainers send the next weights; rollout ranks take them. False: the run stopped
        (a rollout rank of an elastic run learns the stop here)."""
        ...

    def exchange(self, own: Tensor | None, mine: list[Episode], updates: int) -> Round | None:
        """Hands over this rank's packed segment ``own`` and finished episodes ``mine``; None:
        the run stopped (an elastic rollout rank, told by its trainer)."""
        ...

    def before_optimizer_step(self) -> None:
        """The last send must be complete: the optimizer rewrites the bytes being sent."""
        ...

    def update_done(self) -> None:
        """After each update (elastic runs time their joins and leaves from it)."""
        ...

    def stop(self, updates: int, env_steps: int) -> None:
        """The run stopped at ``updates``: tell whoever waits for weights."""
        ...

    def result(self) -> dict[str, Any]:
        """This side's part of the rank's result.json entry."""
        ...


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
