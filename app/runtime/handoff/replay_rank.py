"""A replay rank's part in the hand-off (``layout.replay``): no segments, no weights.

Its serving thread (app/runtime/replay/service.py) holds the replay; its main thread follows
the run as the other ranks do, so that every rank stops at the same update. With static rollout
ranks it shares its (no) episodes over GLOBAL each update and learns everyone's
(:class:`ReplayRankHandOff`). With elastic rollout ranks nothing spans every rank once the run
goes (the trainers take the stop decision among themselves), so it follows its trainers
instead (:class:`ElasticReplayRankHandOff`), as an elastic rollout rank does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from app.runtime.handoff.base import HandOffSettings, Round
from app.runtime.handoff.flat import FlatHandOff
from app.runtime.segments import SegmentFormat
from app.runtime.worker import Episode
from rlcomm import CommContext, LayoutPlan


class ReplayRankHandOff(FlatHandOff):
    """The flat hand-off's episode share alone; its version is the updates done."""

    kind = "replay"

    def __init__(self, ctx: CommContext, plan: LayoutPlan, agent: torch.nn.Module,
                 segment_format: SegmentFormat, settings: HandOffSettings) -> None:
        super().__init__(ctx, plan, agent, segment_format, settings, weights=False)

    def exchange(self, own: torch.Tensor | None, mine: list[Episode], updates: int) -> Round:
        episodes, shared = self._share_episodes(mine, 0)
        return Round([], episodes, {"segments": float(self.collectors), **shared})


class ElasticReplayRankHandOff:
    """A replay rank's side when rollout ranks are elastic: its first exchange lasts the run.

    The trainers write the collectors' segments on to it and say STOP once the run stopped, after
    leaving the job's counts in the store (ElasticLeader.stop); ``served`` returns then (or
    raises what stopped the server), and the rank reports those counts as every rank does.
    """

    kind = "replay"

    def __init__(self, ctx: CommContext, plan: LayoutPlan, served: Callable[[], None]) -> None:
        self.ctx, self.served = ctx, served
        self.lead = min(plan.trainers)
        self.transfer_s = self.wait_total_s = 0.0
        self.weight_bytes_sent = self.trajectory_bytes_sent = 0
        self.staleness: dict[int, int] = {}
        self.on_wait: Callable[[str], None] | None = None
        self.final: dict[str, Any] = {}

    def version(self, updates: int) -> int:
        return 0

    def sync_weights(self, first: bool) -> bool:
        """No weights come to a replay rank."""
        return True

    def exchange(self, own: torch.Tensor | None, mine: list[Episode], updates: int) -> None:
        """None once the run stopped: every trainer said STOP to this rank's server."""
        self.served()
        self.final = json.loads(self.ctx.store.get(f"elastic/{self.lead}/final"))

    def before_optimizer_step(self) -> None:
        """A replay rank trains nothing."""

    def update_done(self) -> None:
        """Not called: the run's one exchange ends it."""

    def stop(self, updates: int, env_steps: int) -> None:
        """The trainers stop the run, not the reverse."""

    def result(self) -> dict[str, Any]:
        """The job's counts, as the lead trainer stopped at, like every rank reports them."""
        return {"updates": self.final.get("updates"), "env_steps": self.final.get("env_steps")}
