"""A replay rank's part in the hand-off (``layout.replay``): no segments, no weights.

Its serving thread (app/runtime/replay_service.py) holds the replay; its main thread follows
the run as the other ranks do, so that every rank stops at the same update: it shares its
(no) episodes over GLOBAL each update and learns everyone's.
"""

from __future__ import annotations

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
