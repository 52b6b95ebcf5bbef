"""The replay on its own ranks (``layout.replay``, Ape-X's replay server), point to point over
the REPLAY group rlcomm creates.

Where the replay lives is a layout decision; the algorithm (app/runtime/replay/offpolicy.py)
does not change: it sees a replay client (app/runtime/replay/client.py) either way. With
replay ranks:

- a collector (a rollout rank, or a colocated trainer) writes each packed segment to its
  replay rank, collector i to ``layout.replay[i mod R]`` (routing's ``replay_rank_of``), as
  segments are routed to trainers;
- each replay rank holds one :class:`~app.runtime.replay.buffer.Replay` shard
  (``loop.replay.capacity`` per replay rank), makes the n-step transitions, keeps the
  priorities and applies the rate limiter (``loop.replay.samples_per_insert`` and
  ``tolerance``, a learner step meaning every trainer's share of a batch) on its own counts,
  in a serving thread (:class:`ReplayServer`), while its main thread follows the run's
  episodes and stop decision as a rollout rank without envs does (its hand-off's route:
  app/runtime/handoff/route.py);
- the hand-off to the trainer carries the rest of the segment (its weights version and the
  normalisers' moments, :attr:`ReplayLink.hand_off_format`), not its transitions;
- a trainer learns through a ``RemoteReplay`` client (app/runtime/replay/client.py), which
  :class:`ReplayLink` hands its algorithm (``Algorithm.learn_from``): ``insert`` does nothing
  (the collectors wrote the segments), ``steps_allowed`` asks every replay rank what its rate
  limiter allows, ``sample`` asks each for its share of the batch (routing's
  ``batch_shares``), ``update_priorities`` sends each its share back.

With elastic rollout ranks (``layout.elastic_rollouts``) the collectors do not write to the
replay ranks: they hand their whole segments to their trainer over the elastic route
(app/runtime/handoff/route_p2p.py), which re-forms around a lost rank and admits a restarted one,
and each trainer writes the segments it received on to the replay ranks (the run's shape's
``forwards``, ``RemoteReplay.insert``). The REPLAY group then carries trainers' and replay ranks' traffic
only, none of which comes and goes: a lost collector loses only what its trainer had not yet
received (counted there as ``segments_discarded``), and no replay rank waits for it. The REPLAY
group still holds every rank (it is planned before the run knows whether rollout ranks are
elastic); a replay server's receive from any of its ranks goes on serving the others when a
rollout rank in it dies, as gloo closes only that rank's connection
(tests/integration/test_replay_any_source.py; tests/e2e/test_replay_ranks_elastic.py kills one).

The messages (a header, a payload, an answer) are app/runtime/replay/messages.py's. A replay
rank serves until every trainer and every writer routed to it said STOP.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from app.runtime.checkpoints.replay_shards import dealt_shards, shard_path, write_shard
from app.runtime.checkpoints.writes import BackgroundWrites
from app.runtime.core.algorithm import Algorithm, Record
from app.runtime.core.seeds import replay_seed
from app.runtime.core.segments import SegmentFormat
from app.runtime.replay.buffer import RateLimiter, Replay, ReplaySettings
from app.runtime.replay.client import RemoteReplay
from app.runtime.replay.messages import (
    ALLOW,
    HEADER_TAG,
    INSERT,
    PAYLOAD_TAG,
    PRIORITIES,
    REPLY_TAG,
    SAMPLE,
    SAVE,
    STOP,
    allow_answer,
    batch_format,
    batch_values,
    header,
    insert_format,
    send,
    tell,
)
from app.runtime.replay.routing import batch_shares, collectors, replay_rank_of, writers_of
from app.runtime.rollout.worker import MOMENTS, as_segment
from rlcomm import CommContext, LayoutPlan, ParallelMode

log = logging.getLogger(__name__)


class ReplayServer:
    """One replay rank's shard, served in a thread (see the module's doc) once :attr:`ready`
    is set (a resumed run's shard restored first: :meth:`restore`). ``checkpoints``: where its
    shard is written beside each checkpoint (``loop.replay.checkpoint``: the lead trainer says
    SAVE); ``forwards``: the trainers write the collectors' segments on
    (``RunShape.forwards``)."""

    def __init__(self, ctx: CommContext, plan: LayoutPlan, settings: ReplaySettings,
                 records: Mapping[str, Record], gamma: float, segment_format: SegmentFormat,
                 seed: int, checkpoints: Path, forwards: bool) -> None:
        self.group = ctx.get_group(ParallelMode.REPLAY)
        rank = ctx.get_global_rank()
        self.holder = (plan.replay.index(rank), len(plan.replay))
        self.checkpoints, self.saves = checkpoints, BackgroundWrites()
        self.share = batch_shares(settings.batch_size, len(plan.replay))[plan.replay.index(rank)]
        self.replay = Replay(dataclasses.replace(settings, batch_size=self.share), records, gamma)
        # The rate limiter, applied here (a trainer asks: ALLOW). A learner step is every
        # trainer's share of a batch; this rank waits for its share of the run's min_size.
        self.limiter = RateLimiter(settings.samples_per_insert, settings.tolerance,
                                   settings.shard_min_size(len(plan.replay)),
                                   len(plan.trainers) * self.share)
        self.segment_format = insert_format(segment_format)
        self.batch_format = batch_format(segment_format, list(records), self.share)
        self.waiting = set(plan.trainers).union(writers_of(plan, rank, forwards))
        self.generator = torch.Generator().manual_seed(seed)
        self.segments = self.batches = 0
        self.error: BaseException | None = None
        self.ready = threading.Event()  # serving may begin: nothing more to restore
        self.thread = threading.Thread(target=self._serve, name="replay server", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def restore(self, picked: Path, update: int) -> None:
        """The shards of the checkpoint ``picked`` (of ``update``) dealt to this replay rank,
        with their counters (before :meth:`start`)."""
        held = dealt_shards(picked, update, *self.holder)
        self.replay.restore(held)
        if held:  # the counters go on from the shard's own (the first, dealt or not)
            self.replay.load_state_dict({"inserts": sum(int(h["inserts"]) for h in held),
                                         "samples": sum(int(h["samples"]) for h in held),
                                         "max_priority": self.replay.max_priority})
        log.info("restored %d replay transitions from %d shard(s) of %s", self.replay.size,
                 len(held), picked.name)

    def join(self, timeout_s: float) -> None:
        """Until every trainer and writer said STOP; re-raises what stopped the thread."""
        self.thread.join(timeout_s)
        if self.error is not None:
            raise self.error
        if self.thread.is_alive():
            raise TimeoutError(f"the replay server still waits for ranks {sorted(self.waiting)}")

    def wait(self) -> None:
        """Until every trainer and writer said STOP, however long the run takes (a replay rank
        whose run follows its trainers: app/runtime/handoff/route.py); re-raises what
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
        self.ready.wait()
        try:
            received = header(0)
            while self.waiting:
                src = dist.recv(received, group=self.group, tag=HEADER_TAG)
                self._answer(int(received[0]), int(received[1]), src)
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
            send(allow_answer(allowed, self._stats()), src, self.group, REPLY_TAG)
        elif kind == SAMPLE:
            send(self._batch(), src, self.group, REPLY_TAG)
        elif kind == PRIORITIES:
            pairs = torch.empty(2, count, dtype=torch.float64)
            dist.recv(pairs, src=src, group=self.group, tag=PAYLOAD_TAG)
            self.replay.update_priorities(pairs[0].long(), pairs[1])
        elif kind == STOP:
            self.waiting.discard(src)
            if not self.waiting:
                self.saves.wait()  # a shard being written is durable before the rank ends
        elif kind == SAVE:
            self._save(count)
        else:
            raise RuntimeError(f"replay server: unknown message kind {kind} from rank {src}")

    def _save(self, update: int) -> None:
        """This rank's shard beside the checkpoint of ``update``, written in the background
        (the previous one waited for; its error raised here, ending the serving)."""
        contents = {**self.replay.contents(), "inserts": self.replay.inserts,
                    "samples": self.replay.samples}
        path = shard_path(self.checkpoints, update, self.holder[0])
        self.saves.submit(lambda: write_shard(path, contents, self.holder[1]), path.name)

    def _stats(self) -> Tensor:
        replay = self.replay
        return torch.tensor([replay.inserts, replay.samples, replay.size,
                             replay.priority_spread()], dtype=torch.float64)

    def _batch(self) -> Tensor:
        batch = self.replay.sample(self.generator)
        self.batches += 1
        return self.batch_format.pack(batch_values(batch, self._stats()))


class ReplayLink:
    """What a rank of a layout with replay ranks does with them: a collector writes its
    segments, a trainer's algorithm learns through a ``RemoteReplay`` client this link hands
    it (``Algorithm.learn_from``), a replay rank serves; without replay ranks, nothing.
    ``forwards``: the trainers write the collectors' segments on (``RunShape.forwards``)."""

    def __init__(self, ctx: CommContext, plan: LayoutPlan, algorithm: Algorithm[Any],
                 segment_format: SegmentFormat, seed: int, checkpoints: Path, *,
                 forwards: bool) -> None:
        rank = ctx.get_global_rank()
        self.timeout_s = ctx.timeout.total_seconds()
        self.segment_format = segment_format
        # What the hand-off carries: all of a segment, or where the collectors write to the
        # replay ranks themselves what the trainer uses besides the transitions (the weights
        # version, the normalisers' moments).
        self.hand_off_format = (SegmentFormat({k: v for k, v in segment_format.fields.items()
                                               if k in ("version", *MOMENTS)})
                                if plan.replay and not forwards else segment_format)
        self.target: int | None = None
        self.remote: RemoteReplay | None = None
        self.server: ReplayServer | None = None
        self.saves_shards = False
        # A collector writes to its replay rank, unless its trainer writes its segments on.
        if plan.replay and rank in collectors(plan) and not forwards:
            self.target = replay_rank_of(plan, rank)
        uses = self.target is not None or rank in plan.trainers or rank in plan.replay
        if not (plan.replay and uses):
            # No replay ranks (a replay per trainer, app/runtime/replay/offpolicy.py), or an elastic
            # rollout rank, which may have joined the running job without any static group.
            return
        self.group = ctx.get_group(ParallelMode.REPLAY)
        settings = algorithm.replay_settings()
        if settings is None:  # refused before launch (app/launch/shape.py)
            raise TypeError(f"layout.replay: {type(algorithm).__name__} does not learn from a "
                            "replay")
        if rank in plan.trainers:
            self.remote = RemoteReplay(ctx, plan, settings, algorithm.records, segment_format,
                                       forwards)
            algorithm.learn_from(self.remote)
        if rank in plan.replay:
            self.server = ReplayServer(ctx, plan, settings, algorithm.records,
                                       algorithm.settings.gamma, segment_format,
                                       replay_seed(seed, rank), checkpoints, forwards)
            self.server.start()  # it serves once begun (a resumed shard restored first)
        self.saves_shards = settings.checkpoint

    def begin(self, picked: Path | None, update: int) -> None:
        """The run resumed from ``picked`` (a checkpoint of ``update``; None: a fresh start):
        a replay rank restores its shard from it (``loop.replay.checkpoint``), then serves."""
        if self.server is None:
            return
        if picked is not None and self.saves_shards:
            self.server.restore(picked, update)
        self.server.ready.set()

    def save_shards(self, update: int) -> None:
        """The lead trainer, as it writes the checkpoint of ``update``: every replay rank
        writes its shard beside it (``loop.replay.checkpoint``)."""
        if self.remote is not None and self.saves_shards:
            for server in self.remote.servers:
                tell(SAVE, server, self.group, update)

    def put(self, packed: Tensor) -> Tensor:
        """A collector's packed segment, to its replay rank (:attr:`target`); what the hand-off
        carries of it (:attr:`hand_off_format`). Its hand-off's route calls it
        (app/runtime/handoff/route.py's ToReplay)."""
        assert self.target is not None, "only a collector with a replay rank writes to one"
        tell(INSERT, self.target, self.group)
        send(packed, self.target, self.group, PAYLOAD_TAG)
        views = self.segment_format.unpack(packed)
        return self.hand_off_format.pack({k: views[k] for k in self.hand_off_format.fields})

    def close(self) -> None:
        """The run ended: say STOP to the replay ranks (a replay rank: serve until all did)."""
        told = set(self.remote.servers) if self.remote is not None else set()
        if self.target is not None:
            told.add(self.target)
        for server in sorted(told):  # once each: a replay rank stops at its last STOP
            tell(STOP, server, self.group)
        if self.server is not None:
            self.server.ready.set()  # a rank that never began (it failed first) serves its STOPs
            self.server.join(self.timeout_s)

    def served(self) -> None:
        """A replay rank: until its server has served the whole run (:meth:`ReplayServer.wait`)."""
        assert self.server is not None, "only a replay rank serves"
        self.server.wait()

    def result(self) -> dict[str, Any]:
        return self.server.result() if self.server is not None else {}

