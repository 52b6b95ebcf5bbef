"""ctx.device_mesh() planned in this process with torch's fake backend: the mesh of a
4,096-rank grid and its groups (one replica group's, with layout.trainer_replicas), and the error without grid groups. On real ranks:
tests/integration/test_device_mesh.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from rlcomm import CommContext, LayoutError, LayoutSpec, ParallelMode, plan_layout

pytestmark = pytest.mark.unit
TP, DP = ParallelMode.TENSOR_PARALLEL.value, ParallelMode.DATA_PARALLEL.value


@pytest.mark.parametrize("rank", [0, 4095])
def test_the_mesh_of_a_4096_rank_grid_has_the_planned_groups(rank: int) -> None:
    world = 4096
    plan = plan_layout(
        LayoutSpec(
            world_size=world, trainers=list(range(world)), tensor_parallel_size=8,
            sequence_parallel_size=4,
        )
    )
    ctx = CommContext()
    ctx.init_distributed_env(world, rank, backend="fake", timeout=60)
    try:
        ctx.init_groups(plan)
        mesh = ctx.device_mesh()
        names = (DP, ParallelMode.SEQUENCE_PARALLEL.value, TP)
        assert mesh.mesh_dim_names == names and tuple(mesh.mesh.shape) == (128, 4, 8)
        for name in names:
            planned = sorted(plan.groups_of(rank)[name])
            assert dist.get_process_group_ranks(mesh.get_group(name)) == planned
            assert mesh.get_group(name) is ctx.get_group(name)
    finally:
        ctx.destroy()


@pytest.mark.parametrize("rank", [0, 2047, 2048, 4095])
def test_with_replica_groups_the_mesh_is_this_ranks_replica_groups_grid(rank: int) -> None:
    """layout.trainer_replicas: each replica group holds a whole grid, DATA_PARALLEL inside it."""
    world = 4096
    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(world)),
                                  tensor_parallel_size=8, trainer_replicas=2))
    ctx = CommContext()
    ctx.init_distributed_env(world, rank, backend="fake", timeout=60)
    try:
        ctx.init_groups(plan)
        mesh = ctx.device_mesh([DP, TP])
        assert tuple(mesh.mesh.shape) == (256, 8)
        block = plan.replica_of(rank)
        assert sorted(mesh.mesh.flatten().tolist()) == list(block) == \
            list(range(2048 * (rank // 2048), 2048 * (rank // 2048 + 1)))
        assert dist.get_process_group_ranks(mesh.get_group(DP)) == sorted(plan.groups_of(rank)[DP])
    finally:
        ctx.destroy()


def test_a_mesh_needs_grid_groups() -> None:
    plan = plan_layout(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=[2, 3]))
    ctx = CommContext()
    ctx.init_distributed_env(4, 0, backend="fake", timeout=60)
    try:
        ctx.init_groups(plan)
        with pytest.raises(Exception, match="the layout plans no DATA_PARALLEL groups"):
            ctx.device_mesh([DP])
        with pytest.raises(LayoutError, match="do not form one row-major grid"):
            ctx.device_mesh([ParallelMode.WEIGHT_TRANSFER, ParallelMode.INTRA_NODE])
    finally:
        ctx.destroy()
