"""The hand-off between trainers and rollout ranks: one interface, chosen by the plan.

A trainer publishes weights through it and receives the segments it trains on; a rollout rank
sends its segments and receives the weights it acts with. The run (app/runtime/run.py)
sees only :class:`HandOff`; the plan picks the implementation (:func:`build_hand_off`):

- :class:`~app.runtime.handoff.flat.FlatHandOff`: a static layout (``layout.elastic_rollouts
  =false``) or a colocated one: a trainer broadcasts its whole weights over WEIGHT_TRANSFER;
- :class:`~app.runtime.handoff.sharded.ShardedHandOff`: a static layout whose trainers are
  sharded (docs/sharding.md): each shard owner sends its own slice to every rollout rank, which
  assembles whole weights; no trainer gathers the model to send it;
- :class:`~app.runtime.handoff.elastic.ElasticLeader` and
  :class:`~app.runtime.handoff.elastic_member.ElasticMember`: rollout ranks that may leave and
  join (``layout.elastic_rollouts``, the default), point to point over membership epochs; each
  trainer sends its whole weights to its own members;
- :class:`~app.runtime.handoff.elastic_sharded.ElasticShardedLeader` and
  :class:`~app.runtime.handoff.elastic_sharded.ElasticShardedMember`: elastic rollout ranks fed
  by sharded trainers: segments as on the elastic path, weights as on the sharded one (each
  owner's slices to every live rollout rank of the job), over job-wide membership changes;
- :class:`~app.runtime.handoff.replay_rank.ReplayRankHandOff`: a replay rank
  (``layout.replay``), which follows the episodes only; with elastic rollout ranks,
  :class:`~app.runtime.handoff.replay_rank.ElasticReplayRankHandOff`, which follows the
  trainers to the run's end.

Checksums (``loop.verify_weights_every``), versions and ``loop.max_staleness`` behave alike on
every path: each is built on rlcomm.weights' sender and receiver.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from app.api import JobInfo
from app.runtime.handoff.base import HandOff, HandOffSettings, Round
from app.runtime.handoff.elastic import ElasticLeader
from app.runtime.handoff.elastic_member import ElasticMember
from app.runtime.handoff.elastic_sharded import ElasticShardedLeader, ElasticShardedMember
from app.runtime.handoff.flat import FlatHandOff
from app.runtime.handoff.replay_rank import ElasticReplayRankHandOff, ReplayRankHandOff
from app.runtime.handoff.sharded import ShardedHandOff
from app.runtime.segments import SegmentFormat
from rlcomm import CommContext, ParallelMode

__all__ = ["HandOff", "HandOffSettings", "Round", "build_hand_off"]


def build_hand_off(ctx: CommContext, job: JobInfo, agent: nn.Module, segment_format: SegmentFormat,
                   trained: Any, settings: HandOffSettings,
                   served: Callable[[], None] | None = None) -> HandOff:
    """The hand-off the plan calls for; ``trained``: a trainer's TrainedModule (None on rollout
    ranks), whose shards a sharded hand-off sends; ``served``: on a replay rank, returns once
    its server has served the run (ReplayLink.served). Before any wrapping of ``agent``: a flat
    or elastic sender binds the agent's tensors to its send buffer, a receiver to its own."""
    plan = job.plan
    rank = ctx.get_global_rank()
    trainer = rank in plan.trainers
    if rank in plan.replay:  # it serves the replay (app/runtime/replay/service.py)
        if not plan.colocated and plan.elastic_rollouts:
            assert served is not None, "a replay rank's hand-off waits for its server"
            return ElasticReplayRankHandOff(ctx, plan, served)
        return ReplayRankHandOff(ctx, plan, agent, segment_format, settings)
    if not plan.colocated and plan.elastic_rollouts:
        if trainer and settings.sharded:
            return ElasticShardedLeader(ctx, agent, segment_format, settings, dict(job.hosts), trained)
        if trainer:
            return ElasticLeader(ctx, agent, segment_format, settings, dict(job.hosts))
        leader = plan.groups_of(rank)[ParallelMode.WEIGHT_TRANSFER.value][0]
        member = ElasticShardedMember if settings.sharded else ElasticMember
        return member(ctx, agent, segment_format, leader, settings, joining=job.joining)
    if not plan.colocated and settings.sharded:
        return ShardedHandOff(ctx, plan, agent, segment_format, trained, settings)
    return FlatHandOff(ctx, plan, agent, segment_format, settings)
