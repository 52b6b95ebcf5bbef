"""A segment on the wire: every field's bytes in one uint8 tensor of a fixed format
(:class:`SegmentFormat`).

A collector packs its segment (and what travels with it: the weights version it was collected
with, the normalisers' batch moments) into one buffer, so a trainer gathers one tensor per
collector over WEIGHT_TRANSFER. Bytes, not float32: image observations stay uint8 and every
dtype round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

_ALIGN = 8  # every field starts on an 8-byte boundary, so any dtype can view its bytes


@dataclass(frozen=True)
class Field:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()


class SegmentFormat:
    """Named fields at fixed offsets in one byte buffer."""

    def __init__(self, fields: Mapping[str, Field]) -> None:
        self.fields = dict(fields)
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, spec in self.fields.items():
            self.offsets[name] = offset
            offset += -(-spec.nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset

    def empty(self) -> Tensor:
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    def pack(self, values: Mapping[str, Tensor], out: Tensor | None = None) -> Tensor:
        """All fields' bytes in one buffer (``out`` when given); every field must be present."""
        buffer = self.empty() if out is None else out
        views = self.unpack(buffer)
        for name, view in views.items():
            view.copy_(values[name].reshape(view.shape))
        return buffer

    def unpack(self, buffer: Tensor) -> dict[str, Tensor]:
        """Each field as a view into ``buffer`` (no copy)."""
        if buffer.dtype != torch.uint8 or buffer.numel() != self.nbytes:
            raise ValueError(f"a packed segment is {self.nbytes} uint8 bytes, got "
                             f"{buffer.numel()} {buffer.dtype}")
        views = {}
        for name, spec in self.fields.items():
            start = self.offsets[name]
            views[name] = buffer[start : start + spec.nbytes].view(spec.dtype).view(spec.shape)
        return views


# What an elastic run's segment also carries (app/runtime/handoff/route_p2p.py).
EPISODE_FIELDS = ("episodes", "episode_count", "wait_s")


def with_episodes(segment_format: SegmentFormat, cap: int) -> SegmentFormat:
    """``segment_format`` plus what a member's segment carries in an elastic run: its finished
    episodes (at most ``cap``: return, length) and the seconds it waited since its last
    segment."""
    fields = dict(segment_format.fields)
    fields["episodes"] = Field((cap, 2), torch.float64)
    fields["episode_count"] = Field((1,), torch.int64)
    fields["wait_s"] = Field((1,), torch.float64)
    return SegmentFormat(fields)


def pack_episodes(segment_format: SegmentFormat, packed: torch.Tensor,
                  episodes: list[tuple[float, int]], wait_s: float) -> None:
    views = segment_format.unpack(packed)
    cap = views["episodes"].shape[0]
    kept = episodes[-cap:]
    views["episode_count"][0] = len(kept)
    if kept:
        views["episodes"][: len(kept)] = torch.tensor(kept, dtype=torch.float64)
    views["wait_s"][0] = wait_s


def unpack_episodes(segment_format: SegmentFormat,
                    packed: torch.Tensor) -> tuple[list[tuple[float, int]], float]:
    views = segment_format.unpack(packed)
    count = int(views["episode_count"][0])
    episodes = [(float(r), int(n)) for r, n in views["episodes"][:count].tolist()]
    return episodes, float(views["wait_s"][0])
