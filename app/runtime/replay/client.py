"""What an off-policy algorithm sees of its replay: a :class:`ReplayClient`, wherever the replay
lives (docs/off-policy.md "Where the replay lives").

- :class:`LocalReplay`: a trainer's own shard, a :class:`~app.runtime.replay.buffer.Replay`
  with its :class:`~app.runtime.replay.buffer.RateLimiter` beside it, both pure torch;
- :class:`RemoteReplay`: a trainer's client of the replay ranks (``layout.replay``), which hold
  the shards and apply the rate limiter on their side (app/runtime/replay/service.py); every
  message it exchanges with them (app/runtime/replay/messages.py) is its own network I/O.

Either way, ``inserts`` and ``samples`` count transitions over the run (a checkpoint keeps them)
and the rate limiter counts from where this attempt's replay started filling (a resumed run's
refill included: the checkpoint keeps the counters, not the contents).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from app.runtime.core.data import Record, Segment
from app.runtime.core.replay_api import Batch, ReplayClient, ReplaySettings
from app.runtime.core.segments import SegmentFormat
from app.runtime.replay.buffer import RateLimiter, Replay
from app.runtime.replay.messages import (
    ALLOW,
    INSERT,
    PAYLOAD_TAG,
    PRIORITIES,
    REPLY_TAG,
    SAMPLE,
    STATS,
    batch_format,
    insert_format,
    joined_batch,
    packed_again,
    priority_pairs,
    send,
    tell,
)
from app.runtime.replay.routing import batch_shares, forwarded_to
from rlcomm import CommContext, LayoutPlan, ParallelMode


def ratio_figures(replay: ReplayClient, counted: tuple[int, int], min_size: int,
                  spread: float) -> dict[str, float]:
    """:meth:`ReplayClient.figures`, from the inserts and samples the limiter ``counted`` (this
    attempt's) and its ``min_size``: the ratio counts from when sampling could begin."""
    past_start = counted[0] - min_size
    return {"replay_size": float(replay.size), "replay_inserts": float(replay.inserts),
            "replay_samples": float(replay.samples),
            "samples_per_insert": counted[1] / past_start if past_start > 0 else 0.0,
            "priority_spread": spread}


class LocalReplay:
    """A trainer's own replay shard and its rate limiter (no replay ranks).

    The limiter is built once the update knows how many trainers share ``min_size`` (the whole
    run's, ``ReplaySettings.shard_min_size``): :meth:`share_among`, at the first update.
    """

    def __init__(self, settings: ReplaySettings, records: Mapping[str, Record],
                 gamma: float) -> None:
        self.settings = settings
        self.shard = Replay(settings, records, gamma)
        self.limiter: RateLimiter | None = None
        # The counters as this attempt's shard started filling: the limiter counts from there.
        self.base = (0, 0)
        self._saved_base = self.base  # the resumed checkpoint's, for a restored shard

    @property
    def inserts(self) -> int:
        return self.shard.inserts

    @property
    def samples(self) -> int:
        return self.shard.samples

    @property
    def size(self) -> int:
        return self.shard.size

    def share_among(self, shards: int) -> None:
        """This shard is one of ``shards`` (the trainers): its limiter waits for its share of
        ``min_size``. The first call builds the limiter; later ones keep it."""
        if self.limiter is None:
            s = self.settings
            self.limiter = RateLimiter(s.samples_per_insert, s.tolerance,
                                       s.shard_min_size(shards), s.batch_size)

    def insert(self, segment: Segment) -> int:
        return self.shard.insert(segment)

    def sample(self, generator: torch.Generator) -> Batch:
        return self.shard.sample(generator)

    def update_priorities(self, indices: Tensor, priorities: Tensor) -> None:
        self.shard.update_priorities(indices, priorities)

    def steps_allowed(self) -> int:
        return self._limiter().steps_allowed(*self._counted(), self.shard.size)

    def steps_to_admit(self, count: int, most: int) -> int:
        return self._limiter().steps_to_admit(*self._counted(), count, most)

    def figures(self) -> dict[str, float]:
        return ratio_figures(self, self._counted(), self._limiter().min_size,
                             self.shard.priority_spread())

    def state_dict(self) -> dict[str, Any]:
        return {**self.shard.state_dict(), "base": list(self.base)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's counters; the shard starts empty and refills to its share of
        ``min_size`` before the learner steps again, unless :meth:`restore` fills it."""
        self.shard.load_state_dict(state)
        self.base = (self.shard.inserts, self.shard.samples)
        saved = state.get("base")
        self._saved_base = (int(saved[0]), int(saved[1])) if saved is not None else self.base

    def contents(self) -> dict[str, Any]:
        """The shard's transitions and priorities (copies), for a replay checkpoint."""
        return self.shard.contents()

    def restore(self, held: Sequence[Mapping[str, Any]]) -> None:
        """A replay checkpoint's shards dealt to this trainer, after the checkpoint's counters
        (:meth:`load_state_dict`): the limiter counts on as it did, with no refill."""
        self.shard.restore(held)
        if self.shard.size:
            self.base = self._saved_base

    def _counted(self) -> tuple[int, int]:
        return self.shard.inserts - self.base[0], self.shard.samples - self.base[1]

    def _limiter(self) -> RateLimiter:
        if self.limiter is None:
            raise RuntimeError("the rate limiter is built at the first update (share_among)")
        return self.limiter


def totals_limiter(settings: ReplaySettings, replays: int, trainers: int) -> RateLimiter:
    """The rate limiter the ``replays`` replay ranks apply, as their totals count: ``min_size``
    (each one's share, summed) and ``tolerance`` all of theirs together, a learner step every
    one of the ``trainers`` trainers' batch. A pure rule: for the learner steps the collectors'
    next inserts wait for (``collector_wait_s``) and the ratio a trainer records."""
    return RateLimiter(settings.samples_per_insert, settings.tolerance * replays,
                       settings.shard_min_size(replays) * replays,
                       settings.batch_size * trainers)


class RemoteReplay:
    """A trainer's client of the replay ranks (``layout.replay``, app/runtime/replay/service.py).

    ``inserts``, ``samples`` and ``size`` are the replay ranks' totals as their last answers
    gave them (a resumed run's counters on top); no storage is held here. The network I/O is
    this client's: :meth:`steps_allowed` asks every replay rank, whose rate limiter is applied
    on its side; :meth:`sample` and :meth:`update_priorities` exchange each one's share.
    """

    def __init__(self, ctx: CommContext, plan: LayoutPlan, settings: ReplaySettings,
                 records: Mapping[str, Record], segment_format: SegmentFormat,
                 forwards: bool = False) -> None:
        self.settings = settings
        self.group = ctx.get_group(ParallelMode.REPLAY)
        self.plan, self.rank = plan, ctx.get_global_rank()
        # With elastic rollout ranks (``forwards``: RunShape.forwards) this trainer writes the
        # segments it was handed on.
        self.writes = insert_format(segment_format) if forwards else None
        self.written = 0  # segments written on so far
        self.servers = list(plan.replay)
        self.shares = batch_shares(settings.batch_size, len(self.servers))
        self.formats = [batch_format(segment_format, list(records), n) for n in self.shares]
        self.stats = {r: torch.zeros(STATS, dtype=torch.float64) for r in self.servers}
        self.limiter = totals_limiter(settings, len(self.servers), len(plan.trainers))
        # A checkpoint's counters, counted on from: the replay ranks start empty.
        self.offset = {"inserts": 0, "samples": 0}
        self.max_priority = 1.0
        self.inserts = self.samples = self.size = 0

    def insert(self, segment: Segment) -> int:
        """Nothing where the collectors wrote the segment to the replay ranks; with elastic
        rollout ranks, the segment written on to a replay rank (routing's ``forwarded_to``)."""
        if self.writes is None:
            return 0
        server = forwarded_to(self.plan, self.rank, self.written)
        tell(INSERT, server, self.group)
        send(packed_again(self.writes, segment), server, self.group, PAYLOAD_TAG)
        self.written += 1
        return int(segment["rewards"].numel())

    def steps_allowed(self) -> int:
        """The learner steps every replay rank allows now (the fewest), asked of each."""
        allowed = []
        for server in self.servers:
            tell(ALLOW, server, self.group)
            answer = torch.empty(1 + STATS, dtype=torch.float64)
            dist.recv(answer, src=server, group=self.group, tag=REPLY_TAG)
            allowed.append(int(answer[0]))
            self._note(server, answer[1:])
        return min(allowed)

    def steps_to_admit(self, count: int, most: int) -> int:
        return self.limiter.steps_to_admit(*self._counted(), count, most)

    def sample(self, generator: torch.Generator) -> Batch:
        """Each replay rank's share of a batch (drawn there with its own generator, so
        ``generator`` draws nothing), in replay-rank order."""
        parts = []
        for server, form in zip(self.servers, self.formats, strict=True):
            tell(SAMPLE, server, self.group)
            packed = form.empty()
            dist.recv(packed, src=server, group=self.group, tag=REPLY_TAG)
            part = form.unpack(packed)
            self._note(server, part.pop("stats"))
            parts.append(part)
        return joined_batch(parts)

    def update_priorities(self, indices: Tensor, priorities: Tensor) -> None:
        """Each replay rank's share of the last batch's new priorities."""
        start = 0
        for server, share in zip(self.servers, self.shares, strict=True):
            pairs = priority_pairs(indices[start:start + share], priorities[start:start + share])
            tell(PRIORITIES, server, self.group, share)
            send(pairs, server, self.group, PAYLOAD_TAG)
            start += share

    def priority_spread(self) -> float:
        """The replay ranks' mean spread (``Replay.priority_spread``)."""
        return float(sum(float(f[3]) for f in self.stats.values()) / len(self.stats))

    def figures(self) -> dict[str, float]:
        return ratio_figures(self, self._counted(), self.limiter.min_size,
                             self.priority_spread())

    def state_dict(self) -> dict[str, Any]:
        return {"inserts": self.inserts, "samples": self.samples,
                "max_priority": self.max_priority}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's counters, counted on from (the replay ranks start empty); with
        ``loop.replay.checkpoint`` the replay ranks restore their own counts with their
        shards, and their answers are the run's totals."""
        self.max_priority = float(state["max_priority"])
        if self.settings.checkpoint:
            return
        self.offset = {"inserts": int(state["inserts"]), "samples": int(state["samples"])}
        self.inserts, self.samples = self.offset["inserts"], self.offset["samples"]

    def _counted(self) -> tuple[int, int]:
        """The replay ranks' totals: their shards started filling with this attempt."""
        return (self.inserts - self.offset["inserts"], self.samples - self.offset["samples"])

    def _note(self, server: int, stats: Tensor) -> None:
        self.stats[server] = stats.clone()
        totals = torch.stack(list(self.stats.values())).sum(0)
        self.inserts = self.offset["inserts"] + int(totals[0])
        self.samples = self.offset["samples"] + int(totals[1])
        self.size = int(totals[2])
