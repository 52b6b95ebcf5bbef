"""State dicts and modules for the weight-transfer tests (tests/integration/test_weight_transfer.py,
tests/integration/test_weight_async.py), on real gloo ranks."""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from rlcomm import CommContext, ParallelMode

WT = ParallelMode.WEIGHT_TRANSFER
TIMEOUT_S = 60.0  # a hang fails the test after this, instead of blocking the suite


@contextmanager
def weight_groups(groups: list[list[int]]) -> Iterator[CommContext]:
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=30)
    try:
        ctx.init_group(groups, WT, backend="gloo")
        yield ctx
    finally:
        ctx.destroy()


def bits(tensor: Tensor) -> Tensor:
    flat = tensor.reshape(-1)
    return flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(torch.uint8)


def mismatches(got: Mapping[str, Tensor], want: Mapping[str, Tensor]) -> list[str]:
    """Names that differ in key set, dtype, shape or any bit (empty when identical)."""
    if set(got) != set(want):
        return [f"keys {sorted(got)} != {sorted(want)}"]
    return [
        name
        for name in want
        if got[name].dtype != want[name].dtype
        or got[name].shape != want[name].shape
        or not torch.equal(bits(got[name]), bits(want[name]))
    ]


def make_trainable(seed: int) -> nn.Module:
    """A float32 MLP that trains (BatchNorm buffers update in place), plus a bf16 buffer."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Linear(13, 3))
    module.register_buffer("scale", torch.randn(5, dtype=torch.bfloat16))
    return module


def snapshot(state: Mapping[str, Tensor]) -> bytes:
    """A copy of ``state`` that crosses the result queue (tensors there would need shared memory
    that dies with the rank)."""
    buffer = io.BytesIO()
    torch.save({k: v.clone() for k, v in state.items()}, buffer)
    return buffer.getvalue()


def restore(raw: bytes) -> dict[str, Tensor]:
    state: dict[str, Tensor] = torch.load(io.BytesIO(raw))
    return state
