"""ctx.device_mesh(): the planned DATA/SEQUENCE/TENSOR_PARALLEL grid as a torch DeviceMesh that
reuses rlcomm's groups, for DTensor / FSDP2 code."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from rlcomm import CommContext, LayoutSpec, ParallelMode, plan_layout
from rlcomm.testing import run_ranks

TP, DP = ParallelMode.TENSOR_PARALLEL.value, ParallelMode.DATA_PARALLEL.value


def _sharded_linear(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    plan = plan_layout(
        LayoutSpec(world_size=4, trainers=[0, 1, 2, 3], tensor_parallel_size=2, data_parallel_size=2)
    )
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)
    ctx.init_groups(plan)
    try:
        mesh = ctx.device_mesh()
        torch.manual_seed(0)  # the same dense layer and input on every rank
        dense = torch.nn.Linear(8, 6)
        x = torch.randn(5, 8)
        expected = dense(x)
        sharded = parallelize_module(
            torch.nn.Linear(8, 6), mesh[TP], ColwiseParallel(use_local_output=False)
        )
        me = mesh[TP].get_local_rank()
        with torch.no_grad():  # each TP rank takes its rows of the dense layer's own weights
            sharded.weight.to_local().copy_(dense.weight.chunk(2)[me])
            sharded.bias.to_local().copy_(dense.bias.chunk(2)[me])
        out = sharded(x)
        full = out.full_tensor() if isinstance(out, DTensor) else out
        return {
            "names": mesh.mesh_dim_names,
            "mesh": mesh.mesh.tolist(),
            "same_groups": all(mesh.get_group(m) is ctx.get_group(m) for m in (TP, DP)),
            "tp_ranks": dist.get_process_group_ranks(mesh.get_group(TP)),
            "max_error": float((full - expected).abs().max()),
            "local_shape": list(sharded.weight.to_local().shape),
        }
    finally:
        ctx.destroy()


@pytest.mark.integration
def test_a_tensor_parallel_linear_on_the_planned_mesh_matches_the_dense_layer() -> None:
    results = run_ranks(_sharded_linear, 4)
    for rank, got in results.items():
        assert got["names"] == (DP, TP)
        assert got["mesh"] == [[0, 1], [2, 3]]
        assert got["same_groups"], "the mesh must reuse rlcomm's groups, not create new ones"
        assert got["tp_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert got["local_shape"] == [3, 8]  # each TP rank holds half of the output features
        assert got["max_error"] < 1e-5


