"""The hand-off one rank uses: a weight channel, a membership and a segment route, composed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from app.runtime.handoff.base import HandOffStats, Round
from app.runtime.handoff.route import SegmentRoute
from app.runtime.handoff.weights import WeightChannel
from app.runtime.membership.base import Membership
from app.runtime.rollout.worker import Episode


class HandOff:
    """One rank's side of the trainer <-> rollout hand-off.

    Per update, every rank calls :meth:`exchange` once and then (unless the run stops)
    :meth:`sync_weights` once; a trainer calls :meth:`before_optimizer_step` before it changes
    the weights being sent and :meth:`update_done` after the update; :meth:`stop` once after
    the last update. ``kind`` (result.json): "flat", "sharded", "elastic", "elastic-sharded" or
    "replay". Built by app/runtime/handoff/__init__.py's ``build_hand_off``, which begins the
    membership (the first groups form, the channel binds the agent).
    """

    def __init__(self, kind: str, weights: WeightChannel, membership: Membership,
                 route: SegmentRoute, stats: HandOffStats) -> None:
        self.kind, self.weights, self.membership, self.route = kind, weights, membership, route
        self.stats = stats
        membership.begin([weights, route])

    @property
    def on_wait(self) -> Callable[[str], None] | None:
        """Told when the run waits for members to join (the progress line, on rank 0)."""
        return self.membership.on_wait

    @on_wait.setter
    def on_wait(self, told: Callable[[str], None] | None) -> None:
        self.membership.on_wait = told

    def version(self, updates: int) -> int:
        """The weights version this rank acts (rollouts) or trains (trainers) with; where no
        weights move (colocated), the number of updates done."""
        return self.weights.version_after(updates)

    def sync_weights(self, first: bool) -> bool:
        """Trainers send the next weights; rollout ranks take them. False: the run stopped
        (a rollout rank of an elastic run learns the stop here)."""
        tick = time.perf_counter()
        going = self.membership.sync(self.weights.sync, first)
        self._spent(tick, self.weights.sends)
        return going

    def before_optimizer_step(self) -> None:
        """The last send must be complete: the optimizer rewrites the bytes being sent."""
        if self.weights.sends:
            tick = time.perf_counter()
            self.weights.settle()
            self._spent(tick, sends=True)

    def exchange(self, own: torch.Tensor | None, mine: list[Episode],
                 updates: int) -> Round | None:
        """Hands over this rank's packed segment ``own`` and finished episodes ``mine``; None:
        the run stopped (an elastic rollout rank, told by its trainer)."""
        return self.route.exchange(own, mine, updates)

    def update_done(self) -> None:
        """After each update (elastic runs time their joins and leaves from it)."""
        self.membership.update_done()

    def stop(self, updates: int, env_steps: int) -> None:
        """The run stopped at ``updates``: tell whoever waits for weights."""
        self.membership.stop(updates, env_steps)

    def result(self) -> dict[str, Any]:
        """This side's part of the rank's result.json entry."""
        return {**self.membership.result(), **self.route.result()}

    def _spent(self, tick: float, sends: bool | None) -> None:
        """Time in the channel: a sender's is transfer time, a taker's waiting."""
        spent = time.perf_counter() - tick
        if sends:
            self.stats.transfer_s += spent
        elif sends is not None:
            self.stats.wait_s += spent
