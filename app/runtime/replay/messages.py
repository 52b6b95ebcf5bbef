"""The replay ranks' messages (``layout.replay``), point to point over the REPLAY group: the one
home of the wire that the replay server (app/runtime/replay/service.py) and the trainers'
client (app/runtime/replay/client.py) share.

A message is a header (int64 ``[kind, count, 0, 0]``, tag 1) from any rank, then, for INSERT and
PRIORITIES, its payload from that rank (tag 2); ALLOW and SAMPLE are answered with tag 3, and
every answer ends with the replay rank's figures (:data:`STATS` float64: inserts, samples,
size, priority spread).

- INSERT: payload a packed segment (:func:`insert_format`); no answer.
- ALLOW: answered float64 ``[learner steps the rank allows now, *figures]``.
- SAMPLE: answered with the rank's share of a batch and its figures (:func:`batch_format`).
- PRIORITIES: payload float64 ``[2, count]``, the share's slots and new priorities; no answer.
- STOP: no answer; a replay rank serves until every trainer and writer routed to it said STOP.
- SAVE: count the update of the checkpoint being written (``loop.replay.checkpoint``); no answer:
  the replay rank writes its shard beside it, in the background.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from app.runtime.core.data import Segment
from app.runtime.core.segments import EPISODE_FIELDS, Field, SegmentFormat
from app.runtime.replay.buffer import Batch

HEADER_TAG, PAYLOAD_TAG, REPLY_TAG = 1, 2, 3
INSERT, ALLOW, SAMPLE, PRIORITIES, STOP, SAVE = range(6)
# What a replay rank reports with every answer: inserts, samples, size, priority spread.
STATS = 4


def header(kind: int, count: int = 0) -> Tensor:
    return torch.tensor([kind, count, 0, 0], dtype=torch.int64)


def send(tensor: Tensor, dst: int, group: Any, tag: int) -> None:
    dist.send(tensor, dst=dst, group=group, tag=tag)


def tell(kind: int, dst: int, group: Any, count: int = 0) -> None:
    """A message's header, to replay rank ``dst``."""
    send(header(kind, count), dst, group, HEADER_TAG)


def insert_format(segment_format: SegmentFormat) -> SegmentFormat:
    """What an INSERT carries: a segment without what an elastic member's segment carries for
    its trainer alone (its episodes and wait, app/runtime/core/segments.py)."""
    return SegmentFormat({k: v for k, v in segment_format.fields.items()
                          if k not in EPISODE_FIELDS})


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


def batch_values(batch: Batch, stats: Tensor) -> dict[str, Tensor]:
    """A SAMPLE answer's fields (:func:`batch_format`): a replay rank's share and its figures."""
    return {"obs": batch.obs, "actions": batch.actions, "rewards": batch.rewards,
            "next_obs": batch.next_obs, "discounts": batch.discounts, "weights": batch.weights,
            "indices": batch.indices, **batch.extras, "stats": stats}


def joined_batch(parts: Sequence[dict[str, Tensor]]) -> Batch:
    """The replay ranks' shares (SAMPLE answers without their figures), in replay-rank order."""
    rows = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    return Batch(obs=rows.pop("obs"), actions=rows.pop("actions"), rewards=rows.pop("rewards"),
                 next_obs=rows.pop("next_obs"), discounts=rows.pop("discounts"),
                 weights=rows.pop("weights"), indices=rows.pop("indices"), extras=rows)


def allow_answer(allowed: int, stats: Tensor) -> Tensor:
    """An ALLOW answer: the learner steps a replay rank allows now, then its figures."""
    return torch.cat([torch.tensor([float(allowed)], dtype=torch.float64), stats])


def priority_pairs(indices: Tensor, priorities: Tensor) -> Tensor:
    """A PRIORITIES payload: a replay rank's slots and their new priorities, float64 [2, B]."""
    return torch.stack([indices.double(), priorities.detach().double()]).contiguous()
