"""The hand-off between trainers and rollout ranks: one object composed of three parts.

A trainer publishes weights through it and receives the segments it trains on; a rollout
rank sends its segments and receives the weights it acts with. The run (app/runtime/run.py)
sees only :class:`HandOff`; :func:`build_hand_off` picks its parts from the run's shape
(``JobInfo.shape``: its ``hand_off`` kind) and this rank's place in the plan:

- the **weight channel** (weights.py, weights_sharded.py): how a version of the weights goes
  from the trainers to whoever acts: whole, from each trainer (flat), or each shard owner's
  slices, assembled by the receiver (sharded: docs/sharding.md); none when colocated;
- the **membership** (membership.py, membership_epochs.py): who is in the group now: the
  layout's (static), or rlcomm.elastic's epochs, re-formed as members leave and join
  (``layout.elastic_rollouts``, the default);
- the **segment route** (route.py, route_p2p.py): where collected data goes: gathered by each
  trainer (static), point to point to the member's trainer (elastic), and with replay ranks
  (``layout.replay``) a collector's transitions to its replay rank first (``ToReplay``); a
  replay rank takes none and follows the episodes (static) or the trainers to the run's end
  (elastic).

A new combination is a new composition here, not a new class. Checksums
(``loop.verify_weights_every``), versions and ``loop.max_staleness`` behave alike on every
channel: each is built on rlcomm.weights' sender and receiver.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from app.api import HandOffKind, JobInfo, RunShape
from app.runtime.core.segments import SegmentFormat
from app.runtime.handoff.base import HandOffSettings, HandOffStats, ReplayHooks, Round
from app.runtime.handoff.handoff import HandOff
from app.runtime.handoff.route import (
    FollowTrainersRoute,
    GatherRoute,
    SegmentRoute,
    Source,
    ToReplay,
)
from app.runtime.handoff.route_p2p import LeaderRoute, MemberRoute
from app.runtime.handoff.weights import FlatReceiver, FlatSender, NoWeights, WeightChannel
from app.runtime.handoff.weights_sharded import ShardReceiver, ShardSender
from app.runtime.membership.base import Membership, StaticMembership
from app.runtime.membership.quorum import Quorum
from app.runtime.membership.rollouts import EpochLeader, EpochMember, epoch_timeout
from rlcomm import CommContext, LayoutPlan, ParallelMode

__all__ = ["HandOff", "HandOffSettings", "HandOffStats", "ReplayHooks", "Round", "build_hand_off",
           "static_hand_off"]

WT, TDP = ParallelMode.WEIGHT_TRANSFER, ParallelMode.TRAIN_DATA_PARALLEL


def build_hand_off(ctx: CommContext, job: JobInfo, agent: nn.Module, segment_format: SegmentFormat,
                   trained: Any, settings: HandOffSettings,
                   replay: ReplayHooks | None = None) -> HandOff:
    """The hand-off the plan calls for; ``trained``: a trainer's TrainedModule (None on rollout
    ranks), whose shards a sharded channel sends; ``replay``: where this rank meets replay
    ranks, if it does. Before any wrapping of ``agent``: a flat channel binds the agent's
    tensors to its send buffer, a receiver to its own."""
    elastic = Elasticity(job.shape.elastic_rollouts, dict(job.hosts), job.joining)
    return _compose(ctx, job.plan, agent, segment_format, trained, settings, elastic,
                    replay or ReplayHooks(), job.shape.hand_off)


def static_hand_off(ctx: CommContext, plan: LayoutPlan, agent: nn.Module,
                    segment_format: SegmentFormat, trained: Any,
                    settings: HandOffSettings) -> HandOff:
    """A static layout's hand-off over ``plan``'s groups, whatever its ``elastic_rollouts``
    says (tests and benchmarks of the flat and sharded channels)."""
    static = RunShape(sharded=settings.sharded, colocated=plan.colocated)
    return _compose(ctx, plan, agent, segment_format, trained, settings, Elasticity(False),
                    ReplayHooks(), static.hand_off)


@dataclass(frozen=True)
class Elasticity:
    """Whether rollout ranks may leave and join (``on``), rank -> host as the job knows them,
    and whether this process replaces a lost rank (``joining``)."""

    on: bool
    hosts: dict[int, str] = field(default_factory=dict)
    joining: bool = False


def _compose(ctx: CommContext, plan: LayoutPlan, agent: nn.Module, segment_format: SegmentFormat,
             trained: Any, settings: HandOffSettings, elasticity: Elasticity,
             replay: ReplayHooks, kind: HandOffKind) -> HandOff:
    """The parts for this rank; ``kind``: the run's hand-off (``RunShape.hand_off``)."""
    elastic, hosts, joining = elasticity.on, elasticity.hosts, elasticity.joining
    rank = ctx.get_global_rank()
    patience = epoch_timeout(ctx, settings.timeout_s) if elastic else None
    stats = HandOffStats()
    if rank in plan.replay:  # it serves the replay (app/runtime/replay/service.py)
        route = _replay_route(ctx, plan, segment_format, settings, stats, elastic, replay.served)
        return HandOff("replay", NoWeights(counts_updates=not elastic), StaticMembership(),
                       route, stats)
    membership = _membership(ctx, plan, settings, patience, hosts, joining)
    weights = _weights(ctx, plan, agent, trained, settings, stats, patience)
    route = _route(ctx, plan, membership, segment_format, settings, stats, weights)
    if replay.write is not None:  # a collector that writes its transitions to a replay rank
        route = ToReplay(replay.write, route)
    return HandOff(kind, weights, membership, route, stats)


def _replay_route(ctx: CommContext, plan: LayoutPlan, segment_format: SegmentFormat,
                  settings: HandOffSettings, stats: HandOffStats, elastic: bool,
                  served: Callable[[], None] | None) -> SegmentRoute:
    """A replay rank follows the trainers (elastic rollout ranks) or the episodes."""
    if elastic:
        assert served is not None, "a replay rank's hand-off waits for its server"
        return FollowTrainersRoute(ctx, plan, served)
    return GatherRoute(ctx, plan, segment_format, settings, stats, lambda updates: updates,
                       Source.NONE)


def _membership(ctx: CommContext, plan: LayoutPlan, settings: HandOffSettings,
                patience: datetime.timedelta | None, hosts: dict[int, str],
                joining: bool) -> Membership:
    """Epochs of each trainer's group of rollout ranks, where they may leave and join."""
    rank = ctx.get_global_rank()
    if patience is None:
        return StaticMembership()
    if rank in plan.trainers:  # joining: it replaces a lost trainer
        quorum = Quorum(settings.min_rollouts, settings.rollout_restarts)
        planned = list(plan.groups_of(rank)[WT.value])
        return EpochLeader(ctx, WT, TDP, quorum, hosts, patience, planned, replacing=joining)
    leader = plan.groups_of(rank)[WT.value][0]
    return EpochMember(ctx, WT, leader, settings.timeout_s, joining, patience)


def _weights(ctx: CommContext, plan: LayoutPlan, agent: nn.Module, trained: Any,
             settings: HandOffSettings, stats: HandOffStats,
             patience: datetime.timedelta | None) -> WeightChannel:
    """Whole weights from each trainer, or each shard owner's slices; none when colocated."""
    rank, elastic = ctx.get_global_rank(), patience is not None
    if plan.colocated:
        return NoWeights(counts_updates=True)
    if rank in plan.trainers:
        if settings.sharded:
            return ShardSender(ctx, plan, agent, trained, settings, stats, patience)
        return FlatSender(ctx, agent, settings, stats, elastic)
    if settings.sharded:
        leader = plan.groups_of(rank)[WT.value][0] if elastic else None
        return ShardReceiver(ctx, None if elastic else plan, agent, settings, leader, patience)
    return FlatReceiver(ctx, agent, settings, elastic)


def _route(ctx: CommContext, plan: LayoutPlan, membership: Membership,
           segment_format: SegmentFormat, settings: HandOffSettings, stats: HandOffStats,
           weights: WeightChannel) -> SegmentRoute:
    """Point to point over the membership's epochs, else gathered (or, colocated, kept)."""
    if isinstance(membership, EpochLeader):
        return LeaderRoute(ctx, membership, segment_format, settings, stats, weights.version_after)
    if isinstance(membership, EpochMember):
        return MemberRoute(ctx, membership, segment_format, stats)
    source = Source.OWN if plan.colocated else Source.GATHER
    return GatherRoute(ctx, plan, segment_format, settings, stats, weights.version_after, source)
