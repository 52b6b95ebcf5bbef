"""The segment route: where the data a rank collects goes, and what each update learns.

On a static layout (:class:`GatherRoute`) a trainer gathers one packed segment per rollout rank
over WEIGHT_TRANSFER (bytes of a fixed segment format, tagged with the weights version it was
collected with: app/runtime/core/segments.py), and over GLOBAL every rank learns every finished
episode, so all stop at the same update; colocated (no rollout ranks) a trainer trains on its
own segment. A replay rank (``layout.replay``) takes no segment: its collectors write their
transitions to it themselves (:class:`ToReplay` around their route; the segment then carries
only the version and the moments), and it follows the episodes (:class:`GatherRoute` with ``Source.NONE``) or, with elastic rollout ranks, the
trainers to the run's end (:class:`FollowTrainersRoute`). Elastic rollout ranks send point to
point to their own trainer: app/runtime/handoff/route_p2p.py.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from app.runtime.core import stopping
from app.runtime.core.algorithm import Segment
from app.runtime.core.segments import SegmentFormat
from app.runtime.handoff.base import HandOffSettings, HandOffStats, Round, check_staleness
from app.runtime.membership.base import Unchanging
from app.runtime.rollout.worker import Episode, as_segment
from rlcomm import CommContext, LayoutPlan, ParallelMode, collectives
from rlcomm.elastic import Keys

WT, GLOBAL = ParallelMode.WEIGHT_TRANSFER, ParallelMode.GLOBAL
Version = Callable[[int], int]  # the weights version after so many updates


class SegmentRoute(Protocol):
    """One rank's end of the data's way; it follows the membership's groups as a weight
    channel does (app/runtime/membership/base.py's Follower)."""

    def exchange(self, own: torch.Tensor | None, mine: list[Episode],
                 updates: int) -> Round | None:
        """Hands over this rank's packed segment ``own`` and finished episodes ``mine``; None:
        the run stopped (a rank that follows its trainer, told by it)."""
        ...

    def begin(self, members: list[int]) -> None: ...

    def agree(self, changing: bool) -> bool: ...

    def end(self, moved: bool, epoch: int) -> None: ...

    def renew(self, epoch: int, members: list[int]) -> None: ...

    def result(self) -> dict[str, Any]:
        """This side's part of the rank's result.json entry."""
        ...


class ToReplay:
    """A collector's route on a layout with replay ranks: its transitions are written to its
    replay rank (``write``: ReplayLink.put), and what the hand-off still carries of the segment
    (its weights version and the normalisers' moments) goes on along ``route``."""

    def __init__(self, write: Callable[[torch.Tensor], torch.Tensor],
                 route: SegmentRoute) -> None:
        self.write, self.route = write, route

    def exchange(self, own: torch.Tensor | None, mine: list[Episode],
                 updates: int) -> Round | None:
        return self.route.exchange(self.write(own) if own is not None else None, mine, updates)

    def begin(self, members: list[int]) -> None:
        self.route.begin(members)

    def agree(self, changing: bool) -> bool:
        return self.route.agree(changing)

    def end(self, moved: bool, epoch: int) -> None:
        self.route.end(moved, epoch)

    def renew(self, epoch: int, members: list[int]) -> None:
        self.route.renew(epoch, members)

    def result(self) -> dict[str, Any]:
        return self.route.result()


class Source(enum.Enum):
    """Where a static layout's trainer gets its segments."""

    GATHER = "gather"  # from its rollout ranks, over WEIGHT_TRANSFER
    OWN = "own"  # colocated: its own
    NONE = "none"  # a replay rank: none


class GatherRoute(Unchanging):
    """A static layout's segments (see the module's doc) and every rank's episodes."""

    def __init__(self, ctx: CommContext, plan: LayoutPlan, segment_format: SegmentFormat,
                 settings: HandOffSettings, stats: HandOffStats, version: Version,
                 source: Source) -> None:
        self.ctx, self.segment_format, self.stats, self.version = ctx, segment_format, stats, version
        self.source = source
        self.rank = ctx.get_global_rank()
        self.is_trainer = self.rank in plan.trainers
        self.collectors = len(plan.trainers) if plan.colocated else len(plan.rollouts)
        self.max_staleness, self.episode_cap = settings.max_staleness, settings.episode_cap

    def result(self) -> dict[str, Any]:
        return {}

    def exchange(self, own: torch.Tensor | None, mine: list[Episode], updates: int) -> Round:
        """This update's segments (a trainer with rollout ranks: theirs; colocated: its own)
        and every rank's finished episodes."""
        if self.source is Source.GATHER:
            segments = self._gather(own, updates)
        elif self.source is Source.OWN and own is not None:
            segments = [as_segment(self.segment_format, own)]
        else:
            segments = []
        lag = max((s.lag for s in segments), default=0)
        episodes, shared, asked = self._share_episodes(mine, lag)
        return Round(segments, episodes, {"segments": float(self.collectors), **shared}, asked)

    def _gather(self, own: torch.Tensor | None, updates: int) -> list[Segment]:
        """The segments the trainer trains on next, each with its version lag (a rollout rank
        gets none). ``own``: this rollout rank's packed segment; ``updates``: the number done."""
        packed = own if own is not None else self.segment_format.empty()
        trainer = self.ctx.get_declared_ranks(WT)[0]
        tick = time.perf_counter()
        gathered = collectives.gather(self.ctx, WT, packed, dst=trainer)
        if self.rank != trainer:
            self.stats.trajectory_bytes_sent += packed.nbytes
        self.stats.wait_s += time.perf_counter() - tick
        if gathered is None:
            return []
        members = self.ctx.get_ranks_in_group(WT)
        segments = [(r, as_segment(self.segment_format, t)) for r, t in zip(members, gathered)
                    if r != trainer]
        versions = [(r, s.version) for r, s in segments]
        lags = check_staleness(versions, self.version(updates), self.max_staleness, updates + 1)
        for (_, segment), lag in zip(segments, lags):
            segment.lag = lag
        self.stats.trained(lags)
        return [segment for _, segment in segments]

    def _share_episodes(
        self, mine: list[Episode], lag: int
    ) -> tuple[list[Episode], dict[str, float], bool]:
        """Everyone learns every finished episode, so all ranks stop at the same update; the
        same message carries each rank's waiting time, its data's version lag and whether it
        was asked to stop (then every rank stops after this update)."""
        packed = torch.full((self.episode_cap + 3, 2), float("nan"))
        kept = mine[-self.episode_cap :]
        packed[0] = torch.tensor([len(kept), float(self.is_trainer)])
        packed[1] = torch.tensor([self.stats.wait_s, lag])
        packed[2] = torch.tensor([float(stopping.asked()), 0.0])
        if kept:
            packed[3 : len(kept) + 3] = torch.tensor(kept, dtype=torch.float32)
        everyone = collectives.all_gather(self.ctx, GLOBAL, packed.unsqueeze(0))
        self.stats.close_wait()
        episodes = []
        waits: dict[bool, list[float]] = {True: [], False: []}
        for block in everyone:
            count, trainer = int(block[0, 0].item()), bool(block[0, 1].item())
            waits[trainer].append(float(block[1, 0]))
            episodes += [(float(r), int(n)) for r, n in block[3 : count + 3].tolist()]
        shared = {
            "staleness": float(everyone[:, 1, 1].max()),
            "trainer_wait_s": float(np.mean(waits[True])),
            "rollout_wait_s": float(np.mean(waits[False])) if waits[False] else 0.0,
        }
        return episodes, shared, bool(everyone[:, 2, 0].max() > 0)


class FollowTrainersRoute(Unchanging):
    """A replay rank's route when rollout ranks are elastic: its first exchange lasts the run.

    Nothing spans every rank once the run goes (the trainers take the stop decision among
    themselves): the trainers write the collectors' segments on to it and say STOP once the run
    stopped, after leaving the job's counts in the store (EpochLeader.stop); ``served`` returns
    then (or raises what stopped the server), and the rank reports those counts as every rank
    does."""

    def __init__(self, ctx: CommContext, plan: LayoutPlan, served: Callable[[], None]) -> None:
        self.ctx, self.served = ctx, served
        self.lead = min(plan.trainers)
        self.final: dict[str, Any] = {}

    def exchange(self, own: torch.Tensor | None, mine: list[Episode], updates: int) -> None:
        """None once the run stopped: every trainer said STOP to this rank's server."""
        self.served()
        self.final = json.loads(self.ctx.store.get(Keys(self.lead).stopped()))

    def result(self) -> dict[str, Any]:
        """The job's counts, as the lead trainer stopped at, like every rank reports them."""
        return {"updates": self.final.get("updates"), "env_steps": self.final.get("env_steps")}
