"""The replay on its own ranks (``layout.replay``, Ape-X's replay server), point to point over
the REPLAY group rlcomm creates.

Where the replay lives is a layout decision; the algorithm (app/runtime/replay/offpolicy.py)
does not change. With replay ranks:

- a collector (a rollout rank, or a colocated trainer) writes each packed segment to its
  replay rank, collector i to ``layout.replay[i mod R]`` (:func:`replay_rank_of`), as segments
  are routed to trainers;
- each replay rank holds one :class:`~app.runtime.replay.buffer.Replay` shard
  (``loop.replay.capacity`` per replay rank), makes the n-step transitions and keeps the priorities,
  in a serving thread (:class:`ReplayServer`), while its main thread follows the run's episodes and
  stop decision as a rollout rank without envs does (app/runtime/handoff/replay_rank.py);
- the hand-off to the trainer carries the rest of the segment (its weights version and the
  normalisers' moments, :attr:`ReplayLink.hand_off_format`), not its transitions;
- a trainer's replay is a :class:`RemoteReplay`: ``insert`` does nothing (the collectors wrote
  the segments), ``sample`` asks every replay rank for its share of the batch
  (:func:`batch_shares`), ``update_priorities`` sends each its share back; the rate limiter
  (:class:`RemoteLimiter`) asks the replay ranks, which count inserts and samples and apply
  ``loop.replay.samples_per_insert`` and ``tolerance`` on their side, a learner step meaning
  every trainer's share of a batch.

With elastic rollout ranks (``layout.elastic_rollouts``) the collectors do not write to the
replay ranks: they hand their whole segments to their trainer over the elastic route
(app/runtime/handoff/elastic.py), which re-forms around a lost rank and admits a restarted one,
and each trainer writes the segments it received on to the replay ranks (:func:`forwards`,
``RemoteReplay.insert``). The REPLAY group then carries trainers' and replay ranks' traffic
only, none of which comes and goes: a lost collector loses only what its trainer had not yet
received (counted there as ``segments_discarded``), and no replay rank waits for it. The REPLAY
group still holds every rank (it is planned before the run knows whether rollout ranks are
elastic); a replay server's receive from any of its ranks goes on serving the others when a
rollout rank in it dies, as gloo closes only that rank's connection
(tests/integration/test_replay_any_source.py; tests/e2e/test_replay_ranks_elastic.py kills one).

Messages: a header (int64 ``[kind, count, 0, 0]``, tag 1) from any rank, then its payload from
that rank (tag 2); answers go back with tag 3. A replay rank serves until every trainer and
every writer routed to it said STOP.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from app.runtime.algorithm import Record, Segment
from app.runtime.replay.buffer import Batch, RateLimiter, Replay, ReplaySettings
from app.runtime.segments import EPISODE_FIELDS, Field, SegmentFormat
from app.runtime.worker import MOMENTS, as_segment
from rlcomm import CommContext, LayoutPlan, ParallelMode

log = logging.getLogger(__name__)

HEADER_TAG, PAYLOAD_TAG, REPLY_TAG = 1, 2, 3
INSERT, ALLOW, SAMPLE, PRIORITIES, STOP = range(5)
# What a replay rank reports with every answer: inserts, samples, size, priority spread.
STATS = 4


def collectors(plan: LayoutPlan) -> tuple[int, ...]:
    """The ranks that collect: the rollout ranks, or the trainers of a colocated layout."""
    return plan.rollouts if plan.rollouts else plan.trainers


def forwards(plan: LayoutPlan) -> bool:
    """Whether the trainers write the collectors' segments to the replay ranks (elastic rollout
    ranks: see the module's doc) rather than the collectors themselves."""
    return bool(plan.replay) and plan.elastic_rollouts and not plan.colocated


def replay_rank_of(plan: LayoutPlan, collector: int) -> int:
    """The replay rank ``collector`` writes to: collector i of :func:`collectors` writes to
    ``plan.replay[i mod R]``."""
    return plan.replay[collectors(plan).index(collector) % len(plan.replay)]


def forwarded_to(plan: LayoutPlan, trainer: int, count: int) -> int:
    """The replay rank the ``count``-th segment a trainer writes on goes to (:func:`forwards`):
    trainer t of T writes its k-th to ``plan.replay[(t + k T) mod R]``, so that every replay
    rank gets its share even with fewer trainers than replay ranks."""
    trainers = plan.trainers
    return plan.replay[(trainers.index(trainer) + count * len(trainers)) % len(plan.replay)]


def writers_of(plan: LayoutPlan, replay_rank: int) -> list[int]:
    """The ranks that write to ``replay_rank``: the collectors routed to it, or, when the
    trainers write on the collectors' segments (:func:`forwards`), the trainers."""
    if forwards(plan):
        return list(plan.trainers)
    return [c for c in collectors(plan) if replay_rank_of(plan, c) == replay_rank]


def insert_format(segment_format: SegmentFormat) -> SegmentFormat:
    """What an INSERT carries: a segment without what an elastic member's segment carries for
    its trainer alone (its episodes and wait, app/runtime/segments.py)."""
    return SegmentFormat({k: v for k, v in segment_format.fields.items()
                          if k not in EPISODE_FIELDS})


def batch_shares(batch_size: int, replays: int) -> list[int]:
    """How many of a learner batch's transitions each replay rank gives: as even as can be,
    the first ranks one more; every share at least one (``batch_size >= replays``)."""
    share, extra = divmod(batch_size, replays)
    return [share + (1 if i < extra else 0) for i in range(replays)]


def packed_again(form: SegmentFormat, segment: Segment) -> Tensor:
    """``segment`` as a collector packed it, in :func:`insert_format` ``form``: what a replay
    rank unpacks from an INSERT (a trainer writing on a segment it was handed)."""
    version = torch.tensor([segment.version], dtype=torch.int64)
    return form.pack({**segment, "version": version, **segment.moments})


def batch_format(segment_format: SegmentFormat, records: Sequence[str],
                 count: int) -> SegmentFormat:
    """``count`` sampled transitions and the replay rank's figures, as one byte buffer: each
    field as the replay makes it from a segment's (app/runtime/replay/buffer.py)."""
    fields = segment_format.fields

    def rows(name: str) -> Field:
        return Field((count, *fields[name].shape[2:]), fields[name].dtype)

    scalar = Field((count,), torch.float32)
    layout = {"obs": rows("obs"), "actions": rows("actions"), "rewards": scalar,
              "next_obs": rows("obs"), "discounts": scalar, "weights": scalar,
              "indices": Field((count,), torch.int64),
              **{name: rows(name) for name in records},
              "stats": Field((STATS,), torch.float64)}
    return SegmentFormat(layout)


def _send(tensor: Tensor, dst: int, group: Any, tag: int) -> None:
    dist.send(tensor, dst=dst, group=group, tag=tag)


def _header(kind: int, count: int = 0) -> Tensor:
    return torch.tensor([kind, count, 0, 0], dtype=torch.int64)


class ReplayServer:
    """One replay rank's shard, served in a thread (see the module's doc)."""

    def __init__(self, ctx: CommContext, plan: LayoutPlan, settings: ReplaySettings,
                 records: Mapping[str, Record], gamma: float, segment_format: SegmentFormat,
                 seed: int) -> None:
        self.group = ctx.get_group(ParallelMode.REPLAY)
        rank = ctx.get_global_rank()
        self.share = batch_shares(settings.batch_size, len(plan.replay))[plan.replay.index(rank)]
        self.replay = Replay(dataclasses.replace(settings, batch_size=self.share), records, gamma)
        # A learner step is every trainer's share of a batch.
        self.limiter = RateLimiter(settings.samples_per_insert, settings.tolerance,
                                   settings.shard_min_size(len(plan.replay)),
                                   len(plan.trainers) * self.share)
        self.segment_format = insert_format(segment_format)
        self.batch_format = batch_format(segment_format, list(records), self.share)
        self.waiting = set(plan.trainers).union(writers_of(plan, rank))
        self.generator = torch.Generator().manual_seed(seed)
        self.segments = self.batches = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="replay server", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        """Until every trainer and writer said STOP; re-raises what stopped the thread."""
        self.thread.join(timeout_s)
        if self.error is not None:
            raise self.error
        if self.thread.is_alive():
            raise TimeoutError(f"the replay server still waits for ranks {sorted(self.waiting)}")

    def wait(self) -> None:
        """Until every trainer and writer said STOP, however long the run takes (a replay rank
        whose run follows its trainers: app/runtime/handoff/replay_rank.py); re-raises what
        stopped the thread. A lost trainer ends the wait too: the server's receive fails
        within the REPLAY group's timeout."""
        while self.thread.is_alive():
            self.thread.join(1.0)
        if self.error is not None:
            raise self.error

    def result(self) -> dict[str, Any]:
        """This replay rank's entry in result.json."""
        replay = self.replay
        return {"replay_server": {"size": replay.size, "inserts": replay.inserts,
                                  "samples": replay.samples, "segments": self.segments,
                                  "batches": self.batches}}

    def _serve(self) -> None:
        try:
            header = _header(0)
            while self.waiting:
                src = dist.recv(header, group=self.group, tag=HEADER_TAG)
                self._answer(int(header[0]), int(header[1]), src)
        except BaseException as error:
            log.error("replay server: %s", error)  # in this rank's log now, not at the join
            self.error = error

    def _answer(self, kind: int, count: int, src: int) -> None:
        if kind == INSERT:
            packed = self.segment_format.empty()
            dist.recv(packed, src=src, group=self.group, tag=PAYLOAD_TAG)
            self.replay.insert(as_segment(self.segment_format, packed))
            self.segments += 1
        elif kind == ALLOW:
            replay = self.replay
            allowed = self.limiter.steps_allowed(replay.inserts, replay.samples, replay.size)
            _send(torch.cat([torch.tensor([float(allowed)], dtype=torch.float64),
                             self._stats()]), src, self.group, REPLY_TAG)
        elif kind == SAMPLE:
            _send(self._batch(), src, self.group, REPLY_TAG)
        elif kind == PRIORITIES:
            pairs = torch.empty(2, count, dtype=torch.float64)
            dist.recv(pairs, src=src, group=self.group, tag=PAYLOAD_TAG)
            self.replay.update_priorities(pairs[0].long(), pairs[1])
        elif kind == STOP:
            self.waiting.discard(src)
        else:
            raise RuntimeError(f"replay server: unknown message kind {kind} from rank {src}")

    def _stats(self) -> Tensor:
        replay = self.replay
        return torch.tensor([replay.inserts, replay.samples, replay.size,
                             replay.priority_spread()], dtype=torch.float64)

    def _batch(self) -> Tensor:
        batch = self.replay.sample(self.generator)
        self.batches += 1
        values = {"obs": batch.obs, "actions": batch.actions, "rewards": batch.rewards,
                  "next_obs": batch.next_obs, "discounts": batch.discounts,
                  "weights": batch.weights, "indices": batch.indices, **batch.extras,
                  "stats": self._stats()}
        return self.batch_format.pack(values)


class RemoteReplay(Replay):
    """A trainer's view of the replay ranks, in place of its own shard (see the module's doc).

    ``inserts``, ``samples`` and ``size`` are the replay ranks' totals as their last answers
    gave them (a resumed run's counters on top); no storage is held here.
    """

    def __init__(self, ctx: CommContext, plan: LayoutPlan, settings: ReplaySettings,
                 records: Mapping[str, Record], segment_format: SegmentFormat) -> None:
        # No Replay.__init__: the storage and priorities live on the replay ranks.
        self.settings, self.fields = settings, dict(records)
        self.group = ctx.get_group(ParallelMode.REPLAY)
        self.plan, self.rank = plan, ctx.get_global_rank()
        # With elastic rollout ranks this trainer writes the segments it was handed on.
        self.writes = insert_format(segment_format) if forwards(plan) else None
        self.written = 0  # segments written on so far
        self.servers = list(plan.replay)
        self.shares = batch_shares(settings.batch_size, len(self.servers))
        self.formats = [batch_format(segment_format, list(records), n) for n in self.shares]
        self.figures = {r: torch.zeros(STATS, dtype=torch.float64) for r in self.servers}
        self.offset = {"inserts": 0, "samples": 0}
        self.max_priority = 1.0
        self.inserts = self.samples = self.size = 0

    def insert(self, segment: Segment) -> int:
        """Nothing where the collectors wrote the segment to the replay ranks; with elastic
        rollout ranks, the segment written on to a replay rank (:func:`forwarded_to`).
        Returns how many transitions this rank wrote."""
        if self.writes is None:
            return 0
        server = forwarded_to(self.plan, self.rank, self.written)
        _send(_header(INSERT), server, self.group, HEADER_TAG)
        _send(packed_again(self.writes, segment), server, self.group, PAYLOAD_TAG)
        self.written += 1
        return int(segment["rewards"].numel())

    def allowance(self) -> int:
        """The learner steps every replay rank allows now (the fewest)."""
        allowed = []
        for server in self.servers:
            _send(_header(ALLOW), server, self.group, HEADER_TAG)
            answer = torch.empty(1 + STATS, dtype=torch.float64)
            dist.recv(answer, src=server, group=self.group, tag=REPLY_TAG)
            allowed.append(int(answer[0]))
            self._note(server, answer[1:])
        return min(allowed)

    def sample(self, generator: torch.Generator) -> Batch:
        """Each replay rank's share of a batch (drawn there), in replay-rank order."""
        parts = []
        for server, form in zip(self.servers, self.formats, strict=True):
            _send(_header(SAMPLE), server, self.group, HEADER_TAG)
            packed = form.empty()
            dist.recv(packed, src=server, group=self.group, tag=REPLY_TAG)
            part = form.unpack(packed)
            self._note(server, part.pop("stats"))
            parts.append(part)
        rows = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
        return Batch(obs=rows.pop("obs"), actions=rows.pop("actions"),
                     rewards=rows.pop("rewards"), next_obs=rows.pop("next_obs"),
                     discounts=rows.pop("discounts"), weights=rows.pop("weights"),
                     indices=rows.pop("indices"), extras=rows)

    def update_priorities(self, indices: Tensor, priorities: Tensor) -> None:
        """Each replay rank's share of the last batch's new priorities."""
        start = 0
        for server, share in zip(self.servers, self.shares, strict=True):
            pairs = torch.stack([indices[start:start + share].double(),
                                 priorities[start:start + share].detach().double()])
            _send(_header(PRIORITIES, share), server, self.group, HEADER_TAG)
            _send(pairs.contiguous(), server, self.group, PAYLOAD_TAG)
            start += share

    def priority_spread(self) -> float:
        """The replay ranks' mean spread (app/runtime/replay/buffer.py's ``priority_spread``)."""
        return float(sum(float(f[3]) for f in self.figures.values()) / len(self.figures))

    def state_dict(self) -> dict[str, Any]:
        return {"inserts": self.inserts, "samples": self.samples,
                "max_priority": self.max_priority}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's counters, counted on from (the replay ranks start empty)."""
        self.offset = {"inserts": int(state["inserts"]), "samples": int(state["samples"])}
        self.max_priority = float(state["max_priority"])
        self.inserts, self.samples = self.offset["inserts"], self.offset["samples"]

    def _note(self, server: int, stats: Tensor) -> None:
        self.figures[server] = stats.clone()
        totals = torch.stack(list(self.figures.values())).sum(0)
        self.inserts = self.offset["inserts"] + int(totals[0])
        self.samples = self.offset["samples"] + int(totals[1])
        self.size = int(totals[2])


class RemoteLimiter(RateLimiter):
    """The rate limiter as the replay ranks apply it (:meth:`RemoteReplay.allowance`). Its
    ``min_size`` (every replay rank's share, summed) and ``tolerance`` are all replay ranks'
    together and a learner step is every trainer's batch, as the replay ranks' totals count
    them: for the ratio a trainer records and the learner steps the collectors' next inserts
    wait for (``collector_wait_s``)."""

    def __init__(self, remote: RemoteReplay, settings: ReplaySettings, trainers: int) -> None:
        replays = len(remote.servers)
        super().__init__(settings.samples_per_insert, settings.tolerance * replays,
                         settings.shard_min_size(replays) * replays,
                         settings.batch_size * trainers)
        self.remote = remote

    def steps_allowed(self, inserts: int, samples: int, size: int) -> int:
        return self.remote.allowance()


class ReplayLink:
    """What a rank of a layout with replay ranks does with them: a collector writes its
    segments, a trainer samples through a :class:`RemoteReplay`, a replay rank serves; without
    replay ranks, nothing."""

    def __init__(self, ctx: CommContext, plan: LayoutPlan, algorithm: Any,
                 segment_format: SegmentFormat, seed: int) -> None:
        rank = ctx.get_global_rank()
        self.timeout_s = ctx.timeout.total_seconds()
        self.segment_format = segment_format
        # What the hand-off carries: all of a segment, or where the collectors write to the
        # replay ranks themselves what the trainer uses besides the transitions (the weights
        # version, the normalisers' moments).
        self.hand_off_format = (SegmentFormat({k: v for k, v in segment_format.fields.items()
                                               if k in ("version", *MOMENTS)})
                                if plan.replay and not forwards(plan) else segment_format)
        self.target: int | None = None
        self.remote: RemoteReplay | None = None
        self.server: ReplayServer | None = None
        # A collector writes to its replay rank, unless its trainer writes its segments on.
        if plan.replay and rank in collectors(plan) and not forwards(plan):
            self.target = replay_rank_of(plan, rank)
        uses = self.target is not None or rank in plan.trainers or rank in plan.replay
        if not (plan.replay and uses):
            # No replay ranks (a replay per trainer, app/runtime/replay/offpolicy.py), or an elastic
            # rollout rank, which may have joined the running job without any static group.
            return
        self.group = ctx.get_group(ParallelMode.REPLAY)
        settings: ReplaySettings = algorithm.replay_settings()
        if rank in plan.trainers:
            self.remote = RemoteReplay(ctx, plan, settings, algorithm.records, segment_format)
            algorithm.use_replay(self.remote, RemoteLimiter(self.remote, settings,
                                                              len(plan.trainers)))
        if rank in plan.replay:
            self.server = ReplayServer(ctx, plan, settings, algorithm.records,
                                       algorithm.settings.gamma, segment_format,
                                       seed * 10_000 + rank)
            self.server.start()

    def put(self, packed: Tensor | None) -> Tensor | None:
        """A collector's packed segment, to its replay rank; what the hand-off carries of it
        (:attr:`hand_off_format`)."""
        if self.target is None or packed is None:
            return packed
        _send(_header(INSERT), self.target, self.group, HEADER_TAG)
        _send(packed, self.target, self.group, PAYLOAD_TAG)
        views = self.segment_format.unpack(packed)
        return self.hand_off_format.pack({k: views[k] for k in self.hand_off_format.fields})

    def close(self) -> None:
        """The run ended: say STOP to the replay ranks (a replay rank: serve until all did)."""
        told = set(self.remote.servers) if self.remote is not None else set()
        if self.target is not None:
            told.add(self.target)
        for server in sorted(told):  # once each: a replay rank stops at its last STOP
            _send(_header(STOP), server, self.group, HEADER_TAG)
        if self.server is not None:
            self.server.join(self.timeout_s)

    def served(self) -> None:
        """A replay rank: until its server has served the whole run (:meth:`ReplayServer.wait`)."""
        assert self.server is not None, "only a replay rank serves"
        self.server.wait()

    def result(self) -> dict[str, Any]:
        return self.server.result() if self.server is not None else {}

