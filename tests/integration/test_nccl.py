"""The nccl path: device binding, CUDA-resident collectives. Runs only where CUDA exists."""

from __future__ import annotations

import pytest
import torch

from rlcomm import CommContext, ParallelMode, collectives
from rlcomm.testing import run_ranks

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="nccl needs a CUDA device; this machine has none"
    ),
]


def _nccl_rank(rank: int, world_size: int) -> dict[str, float]:
    ctx = CommContext()
    ctx.init_distributed_env(backend="nccl", timeout=120)
    ctx.init_group([list(range(world_size))], ParallelMode.TRAIN_DATA_PARALLEL, backend="nccl")
    device = ctx.get_device(ParallelMode.TRAIN_DATA_PARALLEL)
    assert device.type == "cuda" and torch.cuda.current_device() == rank % torch.cuda.device_count()
    out = collectives.all_reduce_dict(ctx, ParallelMode.TRAIN_DATA_PARALLEL, {"r": float(rank)})
    ctx.destroy()
    return out


def test_nccl_groups_and_collectives_on_every_gpu() -> None:
    world = torch.cuda.device_count()  # one rank per GPU: nccl refuses two ranks on one device
    results = run_ranks(_nccl_rank, world, start_method="spawn")
    assert all(r == {"r": float(sum(range(world)))} for r in results.values())
