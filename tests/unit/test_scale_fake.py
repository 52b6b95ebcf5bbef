"""Thousands of ranks simulated in one process with torch's fake backend."""

from __future__ import annotations

import pytest

from rlcomm import CommContext, LayoutSpec, ParallelMode, plan_layout

pytestmark = pytest.mark.unit

WORLD = 4096


@pytest.mark.parametrize("rank", [0, 1, 4095])
def test_4096_rank_rl_layout_as_one_rank(rank: int) -> None:
    plan = plan_layout(
        LayoutSpec(
            world_size=WORLD,
            ranks_per_node=8,
            trainers=list(range(0, WORLD, 2)),
            rollouts=list(range(1, WORLD, 2)),
        )
    )
    ctx = CommContext()
    ctx.init_distributed_env(WORLD, rank, backend="fake", timeout=60)
    try:
        for spec in plan.groups:
            ctx.init_group([list(r) for r in spec.rank_lists], spec.mode, backend="gloo")
        info = ctx.describe()
        trainer = rank - rank % 2
        assert info["WEIGHT_TRANSFER"].ranks == [trainer, trainer + 1]
        assert info["WEIGHT_TRANSFER"].local_rank == rank % 2
        assert info["INTRA_NODE"].ranks == list(range(rank - rank % 8, rank - rank % 8 + 8))
        assert info["INTER_NODE"].world_size == WORLD // 8
        assert info["INTER_NODE"].local_rank == rank // 8
        if rank % 2 == 0:
            assert info["TRAIN_DATA_PARALLEL"].world_size == WORLD // 2
            assert info["TRAIN_DATA_PARALLEL"].local_rank == rank // 2
        else:
            assert "TRAIN_DATA_PARALLEL" not in info
        assert ctx.get_world_size(ParallelMode.GLOBAL) == WORLD
    finally:
        ctx.destroy()
    assert not ctx.is_initialized()
