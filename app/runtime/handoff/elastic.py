"""Elastic rollout ranks (``layout.elastic_rollouts``, the default): the hand-off of a
layout when rollout ranks may leave and join (rlcomm.elastic's membership epochs).

A trainer leads its WEIGHT_TRANSFER group. Per update it receives one segment from each live
member, point to point: a member whose transfer fails is dropped (at once when its connection
closes; when its link is down, after the epoch group's timeout, rlcomm.elastic.patience_s) and
what it had in flight is discarded and counted; training goes on with the others. At the update
boundary it admits the processes that asked to join (rlcomm.elastic.request_join); any change
forms the next epoch: the survivors are told on the old group (rlcomm.weights' "moved" header),
the members acknowledge it in the store, everyone builds the new group, and the first weights
on it are verified by checksum. A trainer left with no live member trains on the job's
segments dealt over the trainers (its surviving rollout ranks serve the job). Below
``loop.min_rollouts`` live members in the whole job the trainers wait that long for joiners, if
one can come, then end the run naming who was lost. The member's side is
app/runtime/handoff/elastic_member.py. Under sharded trainers the weights go another way (each
owner's slices to every rollout rank, job-wide epochs: app/runtime/handoff/elastic_sharded.py,
which overrides the weights side here and nothing else).

Nothing in the steady state spans every rank: a member's finished episodes and waiting time
travel in its segment, the trainers share them over TRAIN_DATA_PARALLEL and take the stop
decision there, and the stop reaches the members as the last header on their group.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app.runtime.algorithm import Segment
from app.runtime.handoff.base import HandOffSettings, Round
from app.runtime.handoff.flat import check_staleness
from app.runtime.segments import EPISODE_FIELDS, SegmentFormat, unpack_episodes
from app.runtime.sharding import share_segments
from app.runtime.worker import Episode, as_segment
from rlcomm import CommContext, ParallelMode, collectives
from rlcomm.diagnostics.watchdog import default_hang_timeout
from rlcomm.elastic import (
    Join,
    Membership,
    drain,
    graveyard,
    patience_s,
    receive_from_members,
)
from rlcomm.errors import MembersLostError
from rlcomm.weights import WeightSender

WT, TDP = ParallelMode.WEIGHT_TRANSFER, ParallelMode.TRAIN_DATA_PARALLEL
log = logging.getLogger(__name__)


def segment_fields(segment_format: SegmentFormat, packed: torch.Tensor) -> Segment:
    """The segment an update sees (views into ``packed``), without the episode fields."""
    segment = as_segment(segment_format, packed)
    for name in EPISODE_FIELDS:
        segment.pop(name, None)
    return segment


@dataclass
class Change:
    """A join or a leave, for result.json."""

    event: str  # "join" | "leave"
    rank: int
    host: str
    reason: str
    epoch: int
    update: int
    time: float = field(default_factory=time.time)
    # Leave: seconds from it being noticed to the next update done with the survivors.
    # Join: its first segment's version lag, and seconds from admission to that segment trained.
    next_update_s: float | None = None
    first_segment_lag: int | None = None
    first_trained_s: float | None = None

    def record(self) -> dict[str, Any]:
        record = {"event": self.event, "rank": self.rank, "host": self.host,
                  "reason": self.reason, "epoch": self.epoch, "update": self.update,
                  "time": round(self.time, 3)}
        if self.event == "leave":
            record["next_update_s"] = _rounded(self.next_update_s)
        else:
            record["first_segment_lag"] = self.first_segment_lag
            record["first_trained_s"] = _rounded(self.first_trained_s)
        return record


def _rounded(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


class ElasticLeader:
    """A trainer's side of an elastic hand-off (see the module's doc)."""

    kind = "elastic"

    def __init__(self, ctx: CommContext, agent: torch.nn.Module, segment_format: SegmentFormat,
                 settings: HandOffSettings, hosts: dict[int, str]) -> None:
        self.ctx, self.agent, self.segment_format = ctx, agent, segment_format
        self.rank = ctx.get_global_rank()
        self.max_staleness, self.verify_every = settings.max_staleness, settings.verify_every
        self.min_rollouts, self.timeout_s = settings.min_rollouts, settings.timeout_s
        self.rollout_restarts = settings.rollout_restarts
        self.counts: list[int] = []  # each trainer's live members this update
        self.patience = epoch_timeout(ctx, self.timeout_s)
        self.patience_s = self.patience.total_seconds()
        self.hosts = dict(hosts)  # rank -> host, as last known
        planned = ctx.get_declared_ranks(WT)
        self.membership = Membership(ctx.store, self.rank, planned)
        self._register(self.membership.group(self.rank, self.patience))  # epoch 0
        self.changes: list[Change] = []
        self.dropped: dict[int, str] = {}  # lost since the current epoch formed
        self.discarded = 0  # segments lost with their member, or left behind by an epoch change
        self.transfer_s = self.wait_s = self.wait_total_s = 0.0
        self.weight_bytes = sum(t.nbytes for t in agent.state_dict().values())
        self.weight_bytes_sent = 0
        self.trajectory_bytes_sent = 0
        self.staleness: dict[int, int] = {}
        self.update = 0
        self.on_wait: Callable[[str], None] | None = None  # the progress line, on rank 0
        self._start_weights()

    # ---- the weights: whole, from this trainer (elastic_sharded.py overrides these) ---------

    def _start_weights(self) -> None:
        """Epoch 0's sender, bound to the agent (zero-copy sends)."""
        self.sender = WeightSender(self.ctx, WT, verify_every=self.verify_every)
        self.sender.bind(self.agent)

    def _send_weights(self, first: bool) -> None:
        self.sender.send(self.agent, wait=first)
        self.weight_bytes_sent += len(self.members) * self.weight_bytes

    def _end_weights(self, moved: bool) -> None:
        """No more versions on this group: tell the members (moved: to a new epoch)."""
        graveyard.append((self.sender, self.ctx.get_group(WT), self.sender.end(moved=moved)))

    def _first_weights(self) -> None:
        """A new epoch's group formed: its first weights, verified whatever
        loop.verify_weights_every says (every member, a joiner above all, starts from them)."""
        version = self.sender.version
        self.sender = WeightSender(self.ctx, WT, verify_every=self.verify_every,
                                   first_version=version)
        self.sender.bind(self.agent)
        self.sender.send(self.agent, wait=True, verify=True)
        self.weight_bytes_sent += len(self.members) * self.weight_bytes

    def _changing(self, joins: list[Join]) -> bool:
        """Whether this update boundary forms a new epoch: here, this group's own changes."""
        return bool(joins or self.dropped)

    def _admitting(self, joins: list[Join]) -> bool:
        """Whether a wait for joiners forms a new epoch: here, when this group has some."""
        return bool(joins)

    @property
    def members(self) -> list[int]:
        return self.membership.members

    @property
    def live(self) -> list[int]:
        """The members not lost since the epoch formed."""
        return [m for m in self.members if m not in self.dropped]

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    def version(self, updates: int) -> int:
        return self.sender.version

    def _register(self, group: Any) -> None:
        self.ctx.register_epoch_group(WT, group, [self.rank, *self.members])

    # ---- the update boundary ------------------------------------------------------------

    def sync_weights(self, first: bool) -> bool:
        """Admits joiners and drops the lost (a new epoch), then sends the next weights."""
        tick = time.perf_counter()
        joins = self.membership.pending_joins()
        if self._changing(joins):
            self._next_epoch(joins)
        else:
            self._send_weights(first)
        self.transfer_s += time.perf_counter() - tick
        return True

    def before_optimizer_step(self) -> None:
        tick = time.perf_counter()
        try:
            self.sender.wait()
        except Exception:  # a member lost while its weights were in flight: dropped next
            graveyard.append(self.sender.abandon())
        self.transfer_s += time.perf_counter() - tick

    def _next_epoch(self, joins: list[Join]) -> None:
        old_group = self.ctx.get_group(WT)
        positions = {m: i + 1 for i, m in enumerate(self.members)}
        survivors = [m for m in self.members if m not in self.dropped]
        joining = []
        for join in joins:
            if join.rank in survivors:  # a new process for a rank we still count as live
                survivors.remove(join.rank)
                self._leave(join.rank, "replaced by a new process")
                self.ctx.store.set(f"elastic/{self.rank}/replaced/{join.rank}", str(join.pid))
            if join.rank not in joining:
                joining.append(join.rank)
            self.hosts[join.rank] = join.host
        members = sorted(survivors + joining)
        # The record first: a survivor told "moved" reads it at once.
        epoch = self.membership.announce(members, joins)
        self._end_weights(moved=True)
        if self.max_staleness:  # what the members sent ahead on the old group
            drain(old_group, list(positions.values()), self.segment_format.nbytes,
                  self.max_staleness + 1)
        tick = time.perf_counter()
        for rank in self.membership.confirm(self.patience_s):  # gone since, or cut off
            if rank in joining:
                joining.remove(rank)
            else:
                self._leave(rank, f"did not answer epoch {epoch} within {self.patience_s:g} s")
        members = list(self.members)
        self._register(self.membership.group(self.rank, self.patience))
        for rank in joining:
            self.changes.append(Change("join", rank, self.hosts.get(rank, "?"),
                                       "admitted", epoch, self.update))
            log.warning("rank %d (%s) joined rank %d's group: epoch %d, %d rollout ranks",
                        rank, self.hosts.get(rank, "?"), self.rank, epoch, len(members))
        self.dropped = {}
        self._first_weights()
        log.info("rank %d: epoch %d formed in %.3f s: members %s", self.rank, epoch,
                 time.perf_counter() - tick, members)

    def update_done(self) -> None:
        """After an update: the times to re-form (result.json's joins and leaves)."""
        now = time.time()
        for change in self.changes:
            if change.event == "leave" and change.next_update_s is None:
                change.next_update_s = now - change.time
            elif change.first_segment_lag is not None and change.first_trained_s is None:
                change.first_trained_s = now - change.time

    def _leave(self, rank: int, reason: str) -> None:
        self.dropped[rank] = reason
        self.changes.append(Change("leave", rank, self.hosts.get(rank, "?"), reason,
                                   self.epoch, self.update))
        log.warning("rank %d (%s) left rank %d's group (%s); %d rollout ranks go on",
                    rank, self.hosts.get(rank, "?"), self.rank, reason,
                    len([m for m in self.members if m not in self.dropped]))

    # ---- segments -----------------------------------------------------------------------

    def exchange(self, own: torch.Tensor | None, mine: list[Episode], updates: int) -> Round:
        """This update's segments from the live members; the trainers share every finished
        episode (the members' segments carried them) and each other's membership, so all stop
        at the same update. Nothing here involves another trainer's rollout ranks."""
        segments, episodes, member_wait = self.gather_segments(updates)
        lag = max((s.lag for s in segments), default=0)
        shared_episodes, shared = self._share_among_trainers(segments, episodes, member_wait,
                                                             lag)
        if min(self.counts) == 0:  # a rollout rank serves the job, not one trainer
            segments = self._deal(segments)
        return Round(segments, shared_episodes, shared)

    def result(self) -> dict[str, Any]:
        """Who left and joined this trainer's group, and what was lost with them."""
        return {
            "epoch": self.epoch,
            "members": list(self.live),
            "changes": [c.record() for c in self.changes],
            "segments_discarded": self.discarded,
        }

    def _share_among_trainers(
        self, segments: list[Segment], episodes: list[Episode], member_wait: float, lag: int
    ) -> tuple[list[Episode], dict[str, float]]:
        """Every trainer's episodes, counts and waits, over TRAIN_DATA_PARALLEL."""
        cap = self.segment_format.fields["episodes"].shape[0] * max(1, len(self.members))
        kept = episodes[-cap:]
        row = torch.full((cap + 2, 3), float("nan"), dtype=torch.float64)
        row[0] = torch.tensor([len(kept), len(segments), len(self.live)])
        row[1] = torch.tensor([self.wait_s, member_wait, lag])
        self.wait_total_s += self.wait_s
        self.wait_s = 0.0
        if kept:
            row[2 : len(kept) + 2, :2] = torch.tensor(kept, dtype=torch.float64)
        size = torch.tensor([float(cap)])
        largest = int(collectives.all_reduce(self.ctx, TDP, size,
                                             torch.distributed.ReduceOp.MAX).item())
        if largest > cap:  # members joined elsewhere: everyone's block has the same shape
            row = torch.cat([row, torch.full((largest - cap, 3), float("nan"),
                                             dtype=torch.float64)])
        epoch = torch.tensor([float(self.epoch)])
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

    def gather_segments(self, updates: int) -> tuple[list[Segment], list[Episode], float]:
        """This update's segments from the live members, their episodes and mean waiting time;
        when the job as a whole has fewer than ``min_rollouts`` live members, waits for joiners
        first (up to the patience), or ends the run at once if none can come."""
        self.update = updates
        tick = time.perf_counter()
        received = self._enough_members(self._receive())
        self.wait_s += time.perf_counter() - tick
        segments, episodes, waits = [], [], []
        versions = []
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
            self.staleness[lag] = self.staleness.get(lag, 0) + 1
        for (rank, _), lag in zip(versions, lags):
            for change in self.changes:
                if change.event == "join" and change.rank == rank and \
                        change.first_segment_lag is None:
                    change.first_segment_lag = lag
        return segments, episodes, (sum(waits) / len(waits) if waits else 0.0)

    def _enough_members(
        self, received: list[tuple[int, torch.Tensor]]
    ) -> list[tuple[int, torch.Tensor]]:
        """``received``, once the job has ``min_rollouts`` live members. Every trainer takes
        part (so none waits alone in a collective of theirs, where it would be diagnosed as
        hung): those with joiners admit them, the others wait with them."""
        deadline: float | None = None
        while True:
            counts, joinable = self._job_counts(len(received))
            live = sum(counts)
            if live >= self.min_rollouts:
                self.counts = counts
                return received
            lost = ", ".join(f"rank {c.rank} on {c.host} ({c.reason})"
                             for c in self.changes if c.event == "leave") or \
                "by the other trainers' groups"
            if not joinable:
                raise MembersLostError(
                    f"{live} live rollout ranks of loop.min_rollouts={self.min_rollouts}, and "
                    f"none can join (launcher.rollout_restarts={self.rollout_restarts}); "
                    f"lost: {lost}")
            if deadline is None:
                deadline = time.monotonic() + self.patience_s
                text = (f"waiting up to {self.patience_s:g} s for rollout ranks to join: "
                        f"{live} live of loop.min_rollouts={self.min_rollouts}; lost: {lost}")
                log.warning("rank %d %s", self.rank, text)
                if self.on_wait is not None:
                    self.on_wait(text)
            if time.monotonic() > deadline:
                raise MembersLostError(
                    f"{live} live rollout ranks of loop.min_rollouts={self.min_rollouts} for "
                    f"{self.patience_s:g} s; lost: {lost}")
            joins = self.membership.pending_joins()
            if self._admitting(joins):
                self._next_epoch(joins)
                received += self._receive()
                continue
            time.sleep(0.05)

    def _job_counts(self, received: int) -> tuple[list[int], bool]:
        """Each trainer's live members this update, and whether a lost one can still come
        back to any trainer (a restart left, or a join by hand)."""
        row = torch.tensor([[float(received), float(self._can_rejoin())]])
        everyone = collectives.all_gather(self.ctx, TDP, row).reshape(-1, 2)
        return [int(n) for n in everyone[:, 0].tolist()], bool(everyone[:, 1].max() > 0)

    def _can_rejoin(self) -> bool:
        """Whether a rank this trainer lost can be replaced: always by hand (torchrun, srun);
        under the local launcher while ``launcher.rollout_restarts`` are left for it."""
        losses: dict[int, int] = {}
        for change in self.changes:
            if change.event == "leave" and change.reason != "replaced by a new process":
                losses[change.rank] = losses.get(change.rank, 0) + 1
        gone = [rank for rank in losses if rank not in self.live]
        if self.rollout_restarts is None:
            return bool(gone)
        return any(losses[rank] <= self.rollout_restarts for rank in gone)

    def _deal(self, segments: list[Segment]) -> list[Segment]:
        """Some trainer got no segment this update but the job did: the job's segments are
        dealt over the trainers (round robin; with fewer segments than trainers, a trainer
        trains on a copy of one whose statistics another trainer folds in)."""
        template = segment_fields(self.segment_format, self.segment_format.empty())
        template.moments = {k: torch.zeros_like(v) for k, v in template.moments.items()}
        everyone = share_segments(self.ctx, segments, TDP, template=template)
        trainers = len(self.counts)
        me = self.ctx.get_local_rank(TDP)
        if len(everyone) >= trainers:
            return everyone[me::trainers]
        copy = everyone[me % len(everyone)]
        if me >= len(everyone):
            copy.moments = {k: torch.zeros_like(v) for k, v in copy.moments.items()}
        return [copy]

    def _receive(self) -> list[tuple[int, torch.Tensor]]:
        live = [m for m in self.members if m not in self.dropped]
        positions = {m: i + 1 for i, m in enumerate(self.members)}
        buffers = {m: self.segment_format.empty() for m in live}
        lost = receive_from_members(self.ctx.get_group(WT), buffers,
                                    {m: positions[m] for m in live})
        for rank, reason in lost.items():
            self.discarded += 1
            self._leave(rank, reason)
        return [(m, buffers[m]) for m in live if m not in lost]

    def stop(self, updates: int, env_steps: int) -> None:
        """The run stopped: the job's counts go in the store (the members report them, and rank
        0 collects the reports of the members listed there), then the members are told, and
        what they sent ahead is taken off them."""
        group = self.ctx.get_group(WT)
        live = [i + 1 for i, m in enumerate(self.members) if m not in self.dropped]
        self.ctx.store.set(f"elastic/{self.rank}/final", json.dumps(
            {"members": self.live, "updates": updates, "env_steps": env_steps}))
        self._end_weights(moved=False)
        drain(group, live, self.segment_format.nbytes, self.max_staleness + 1)


def epoch_timeout(ctx: CommContext, timeout_s: float) -> datetime.timedelta:
    """Every epoch group's timeout (rlcomm.elastic.patience_s), from this rank's hang timeout
    (a joiner, without a watchdog, derives it as the others do from comm.timeout)."""
    hang = ctx.watchdog.hang_timeout if ctx.watchdog is not None else \
        default_hang_timeout(timeout_s)
    return datetime.timedelta(seconds=patience_s(timeout_s, hang))
