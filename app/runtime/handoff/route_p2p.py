"""Segments point to point, from each member to its leader, over the leader's membership epochs
(app/runtime/membership/rollouts.py): elastic rollout ranks to their trainer.

Per update a leader receives one segment from each live member: a member whose transfer fails
is dropped (the membership's leave) and what it had in flight is discarded and counted;
training goes on with the others. A leader left with no live member trains on the job's
segments dealt over the leaders (its surviving members serve the job). Nothing in the steady
state spans every rank: a member's finished episodes and waiting time travel in its segment,
the leaders share them over TRAIN_DATA_PARALLEL and take the stop decision there, and the stop
reaches the members as the last header of the weight channel on their group.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from app.runtime.core.algorithm import Segment
from app.runtime.core.segments import EPISODE_FIELDS, SegmentFormat, pack_episodes, unpack_episodes
from app.runtime.handoff.base import HandOffSettings, HandOffStats, Round, check_staleness
from app.runtime.handoff.route import Version
from app.runtime.membership.base import Unchanging
from app.runtime.membership.rollouts import EpochLeader, EpochMember
from app.runtime.rollout.worker import Episode, as_segment
from app.runtime.trainer.trained import share_segments
from rlcomm import CommContext, ParallelMode, collectives
from rlcomm.elastic import drain, receive_from_members, send_to_leader

WT, TDP = ParallelMode.WEIGHT_TRANSFER, ParallelMode.TRAIN_DATA_PARALLEL


def segment_fields(segment_format: SegmentFormat, packed: torch.Tensor) -> Segment:
    """The segment an update sees (views into ``packed``), without the episode fields."""
    segment = as_segment(segment_format, packed)
    for name in EPISODE_FIELDS:
        segment.pop(name, None)
    return segment


class LeaderRoute:
    """A trainer's end: segments from its own live members (see the module's doc)."""

    def __init__(self, ctx: CommContext, membership: EpochLeader, segment_format: SegmentFormat,
                 settings: HandOffSettings, stats: HandOffStats, version: Version) -> None:
        self.ctx, self.membership, self.segment_format = ctx, membership, segment_format
        self.stats, self.version = stats, version
        self.max_staleness = settings.max_staleness
        self.group_members: list[int] = []  # the members of the group the segments come on
        self.discarded = 0  # segments lost with their member, or left behind by an epoch change

    def begin(self, members: list[int]) -> None:
        self.group_members = list(members)

    def agree(self, changing: bool) -> bool:
        return changing

    def end(self, moved: bool, epoch: int) -> None:
        """Takes off the members what they sent ahead on the group that ends (at the stop,
        from the live ones)."""
        if moved and not self.max_staleness:
            return
        members = self.group_members
        positions = [i + 1 for i, m in enumerate(members)
                     if moved or m not in self.membership.dropped]
        drain(self.ctx.get_group(WT), positions, self.segment_format.nbytes,
              self.max_staleness + 1)

    def renew(self, epoch: int, members: list[int]) -> None:
        self.group_members = list(members)

    def result(self) -> dict[str, Any]:
        return {"segments_discarded": self.discarded}

    def exchange(self, own: torch.Tensor | None, mine: list[Episode], updates: int) -> Round:
        """This update's segments from the live members; the leaders share every finished
        episode (the members' segments carried them) and each other's membership, so all stop
        at the same update. Nothing here involves another leader's members."""
        segments, episodes, member_wait = self._segments(updates)
        lag = max((s.lag for s in segments), default=0)
        shared_episodes, shared = self._share_among_leaders(segments, episodes, member_wait, lag)
        if min(self.membership.counts) == 0:  # a member serves the job, not one leader
            segments = self._deal(segments)
        return Round(segments, shared_episodes, shared)

    def _segments(self, updates: int) -> tuple[list[Segment], list[Episode], float]:
        """This update's segments from the live members, their episodes and mean waiting time;
        the job's quorum of live members first (app/runtime/membership/rollouts.py)."""
        self.membership.update = updates
        tick = time.perf_counter()
        received = self._receive()

        def receive_more() -> int:
            more = self._receive()
            received.extend(more)
            return len(more)

        self.membership.await_quorum(len(received), receive_more)
        self.stats.wait_s += time.perf_counter() - tick
        segments, episodes, waits, versions = [], [], [], []
        for rank, packed in received:
            new, wait = unpack_episodes(self.segment_format, packed)
            episodes += new
            waits.append(wait)
            segment = segment_fields(self.segment_format, packed)
            segments.append(segment)
            versions.append((rank, segment.version))
        lags = check_staleness(versions, self.version(updates), self.max_staleness, updates + 1)
        for segment, lag in zip(segments, lags):
            segment.lag = lag
        self.stats.trained(lags)
        for (rank, _), lag in zip(versions, lags):
            self.membership.first_segment(rank, lag)
        return segments, episodes, (sum(waits) / len(waits) if waits else 0.0)

    def _receive(self) -> list[tuple[int, torch.Tensor]]:
        members, live = self.membership.members, self.membership.live
        positions = {m: i + 1 for i, m in enumerate(members)}
        buffers = {m: self.segment_format.empty() for m in live}
        lost = receive_from_members(self.ctx.get_group(WT), buffers,
                                    {m: positions[m] for m in live})
        for rank, reason in lost.items():
            self.discarded += 1
            self.membership.leave(rank, reason)
        return [(m, buffers[m]) for m in live if m not in lost]

    def _share_among_leaders(
        self, segments: list[Segment], episodes: list[Episode], member_wait: float, lag: int
    ) -> tuple[list[Episode], dict[str, float]]:
        """Every leader's episodes, counts and waits, over TRAIN_DATA_PARALLEL."""
        membership = self.membership
        cap = self.segment_format.fields["episodes"].shape[0] * max(1, len(membership.members))
        kept = episodes[-cap:]
        row = torch.full((cap + 2, 3), float("nan"), dtype=torch.float64)
        row[0] = torch.tensor([len(kept), len(segments), len(membership.live)])
        row[1] = torch.tensor([self.stats.close_wait(), member_wait, lag])
        if kept:
            row[2 : len(kept) + 2, :2] = torch.tensor(kept, dtype=torch.float64)
        size = torch.tensor([float(cap)])
        largest = int(collectives.all_reduce(self.ctx, TDP, size,
                                             torch.distributed.ReduceOp.MAX).item())
        if largest > cap:  # members joined elsewhere: everyone's block has the same shape
            row = torch.cat([row, torch.full((largest - cap, 3), float("nan"),
                                             dtype=torch.float64)])
        epoch = torch.tensor([float(membership.epoch)])
        everyone = collectives.all_gather(self.ctx, TDP,
                                          torch.cat([row, epoch.expand(1, 3).double()]).unsqueeze(0))
        shared_episodes: list[Episode] = []
        for block in everyone:
            count = int(block[0, 0].item())
            shared_episodes += [(float(r), int(n)) for r, n, _ in block[2 : count + 2].tolist()]
        return shared_episodes, {
            "segments": float(everyone[:, 0, 1].sum()),
            "members": float(everyone[:, 0, 2].sum()),
            "epoch": float(everyone[:, -1, 0].sum()),
            "staleness": float(everyone[:, 1, 2].max()),
            "trainer_wait_s": float(everyone[:, 1, 0].mean()),
            "rollout_wait_s": float(everyone[:, 1, 1].mean()),
        }

    def _deal(self, segments: list[Segment]) -> list[Segment]:
        """Some leader got no segment this update but the job did: the job's segments are
        dealt over the leaders (round robin; with fewer segments than leaders, a leader trains
        on a copy of one whose statistics another leader folds in)."""
        template = segment_fields(self.segment_format, self.segment_format.empty())
        template.moments = {k: torch.zeros_like(v) for k, v in template.moments.items()}
        everyone = share_segments(self.ctx, segments, TDP, template=template)
        leaders = len(self.membership.counts)
        me = self.ctx.get_local_rank(TDP)
        if len(everyone) >= leaders:
            return everyone[me::leaders]
        copy = everyone[me % len(everyone)]
        if me >= len(everyone):
            copy.moments = {k: torch.zeros_like(v) for k, v in copy.moments.items()}
        return [copy]


class MemberRoute(Unchanging):
    """A rollout rank's end: its segment, with its finished episodes and waiting time, to its
    trainer; a failed send follows the trainer to its next epoch (the membership's)."""

    def __init__(self, ctx: CommContext, membership: EpochMember, segment_format: SegmentFormat,
                 stats: HandOffStats) -> None:
        self.ctx, self.membership, self.segment_format = ctx, membership, segment_format
        self.stats = stats
        self.segments_sent = 0

    def result(self) -> dict[str, Any]:
        return {"segments_sent": self.segments_sent}

    def exchange(self, own: torch.Tensor | None, mine: list[Episode],
                 updates: int) -> Round | None:
        """Sends this rank's segment to its trainer; None once the run stopped."""
        assert own is not None
        pack_episodes(self.segment_format, own, mine, self.stats.close_wait())
        tick = time.perf_counter()
        try:
            send_to_leader(self.ctx.get_group(WT), own)
        except RuntimeError as err:
            # Lost with the group: True when this rank followed its trainer to a new epoch
            # and holds its first weights (the next sync has nothing to take).
            going = self.membership.recover(err)
            self.membership.followed = going
            self.stats.wait_s += time.perf_counter() - tick
            return Round(shared={"segments": 0.0}) if going else None
        self.stats.trajectory_bytes_sent += own.nbytes
        self.stats.wait_s += time.perf_counter() - tick
        self.segments_sent += 1
        return Round(shared={"segments": 1.0})
