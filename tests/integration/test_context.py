"""CommContext on real processes over gloo: its 14 original methods (docs/library.md), their
fixes, and their errors."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from rlcomm import (
    BackendError,
    CommContext,
    CommMode,
    GroupRegistrationError,
    LayoutError,
    ModeNotRegisteredError,
    ParallelMode,
)
from rlcomm.group_initializer import GroupInitializer, register_initializer
from rlcomm.testing import run_ranks


def _seed_sequence(rank: int, world_size: int) -> dict[str, Any]:
    # The original API's documented call order, with gloo groups because this machine has no CUDA.
    ctx = CommContext()
    assert not ctx.is_initialized()
    ctx.init_distributed_env(world_size, rank, backend="gloo", dist_url="env://", timeout=60)
    assert ctx.is_initialized() and CommContext() is ctx
    ctx.init_group([0, 1], ParallelMode.TRAIN_DATA_PARALLEL, backend="gloo")
    ctx.init_group([[0, 1], [2, 3]], ParallelMode.INTRA_NODE, use_cpu=True)
    ctx.init_group([[0, 2], [1, 3]], ParallelMode.WEIGHT_TRANSFER, backend="gloo")
    seen = {
        "global_rank": ctx.get_global_rank(),
        "is_main": ctx.is_main_rank(),
        "world": ctx.get_world_size(CommMode.GLOBAL),
        "in_node_rank": ctx.get_in_node_rank(),
        "local_world": ctx.get_local_world_size(),
        "intra": torch.distributed.get_process_group_ranks(ctx.get_intra_node_process_group()),
        "wt_rank": ctx.get_local_rank(ParallelMode.WEIGHT_TRANSFER),
        "wt_ranks": ctx.get_ranks_in_group(ParallelMode.WEIGHT_TRANSFER),
        "torch_wt_rank": torch.distributed.get_rank(ctx.get_group(ParallelMode.WEIGHT_TRANSFER)),
        "modes": sorted(ctx.describe()),
    }
    if rank >= 2:
        with pytest.raises(ModeNotRegisteredError) as info:
            ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL)
        seen["missing"] = str(info.value)
    ctx.destroy()
    assert not ctx.is_initialized()
    return seen


@pytest.mark.integration
def test_seed_call_sequence_on_four_ranks() -> None:
    results = run_ranks(_seed_sequence, 4)
    for rank, seen in results.items():
        assert seen["global_rank"] == rank and seen["world"] == 4
        assert seen["is_main"] == (rank == 0)
        assert seen["in_node_rank"] == rank and seen["local_world"] == 4
        assert seen["intra"] == ([0, 1] if rank < 2 else [2, 3])
        assert seen["wt_ranks"] == [rank % 2, rank % 2 + 2]
        assert seen["wt_rank"] == seen["torch_wt_rank"] == rank // 2
    assert results[0]["modes"] == ["GLOBAL", "INTRA_NODE", "TRAIN_DATA_PARALLEL", "WEIGHT_TRANSFER"]
    assert results[2]["modes"] == ["GLOBAL", "INTRA_NODE", "WEIGHT_TRANSFER"]
    assert results[3]["missing"] == (
        "rank 3 is not a member of any TRAIN_DATA_PARALLEL group; its modes: "
        "GLOBAL, INTRA_NODE, WEIGHT_TRANSFER"
    )


def _every_mode(rank: int, world_size: int) -> dict[str, Any]:
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)  # world size and rank from env://
    # The trainer (3) has a higher global rank than its rollouts (0, 1); rank 2 is elsewhere.
    ctx.init_group([[3, 0, 1]], ParallelMode.WEIGHT_TRANSFER, backend="gloo")
    ctx.init_group([2, 3], ParallelMode.TRAIN_DATA_PARALLEL, backend="gloo")
    ctx.init_group([[0, 1, 2, 3]], CommMode.INTRA_NODE, backend="gloo")
    ctx.init_group([[0], [1], [2], [3]], ParallelMode.INTER_NODE, backend="gloo")
    ctx.init_group([0, 1, 2, 3], ParallelMode.TENSOR_PARALLEL, backend="gloo", group_size=2)
    ctx.init_group(
        [0, 1, 2, 3], ParallelMode.SEQUENCE_PARALLEL, backend="gloo", group_size=1,
        tensor_parallel_size=2,
    )
    ctx.init_group([0, 1, 2, 3], ParallelMode.DATA_PARALLEL, backend="gloo", group_size=2)
    info = ctx.describe()
    out: dict[str, Any] = {m: (i.local_rank, i.world_size, i.ranks) for m, i in info.items()}
    for mode in info:
        group = ctx.get_group(mode)
        assert torch.distributed.get_rank(group) == ctx.get_local_rank(mode)
        assert torch.distributed.get_process_group_ranks(group) == ctx.get_ranks_in_group(mode)
    out["intra_same_group"] = ctx.get_group(ParallelMode.INTRA_NODE) is ctx.get_group(
        CommMode.INTRA_NODE
    )
    # The original class's _tensor_parallel_size/_data_parallel_size attributes repeated these.
    out["sizes"] = (ctx.get_world_size(ParallelMode.TENSOR_PARALLEL),
                    ctx.get_world_size(ParallelMode.DATA_PARALLEL))
    if rank != 2:
        out["declared"] = ctx.get_declared_ranks(ParallelMode.WEIGHT_TRANSFER)
    ctx.destroy()
    return out


@pytest.mark.integration
def test_every_mode_and_trainer_with_higher_rank_than_rollouts() -> None:
    results = run_ranks(_every_mode, 4)
    assert results[3]["WEIGHT_TRANSFER"] == (2, 3, [0, 1, 3])  # torch sorts: trainer is last
    assert results[0]["WEIGHT_TRANSFER"] == (0, 3, [0, 1, 3])
    assert results[3]["declared"] == [3, 0, 1]
    assert "WEIGHT_TRANSFER" not in results[2]
    assert results[2]["TRAIN_DATA_PARALLEL"] == (0, 2, [2, 3])
    assert results[1]["INTER_NODE"] == (0, 1, [1])
    assert results[1]["TENSOR_PARALLEL"] == (1, 2, [0, 1])
    assert results[1]["SEQUENCE_PARALLEL"] == (0, 1, [1])
    assert results[1]["DATA_PARALLEL"] == (0, 2, [1, 3])
    assert all(r["intra_same_group"] for r in results.values())
    assert results[0]["sizes"] == (2, 2)


class _PairInitializer(GroupInitializer):
    """A user mode: neighbours (0,1), (2,3), ... derived without editing rlcomm."""

    def rank_lists(self) -> tuple[tuple[int, ...], ...]:
        return tuple((r, r + 1) for r in range(0, self.world_size, 2))


def _user_mode_and_errors(rank: int, world_size: int) -> dict[str, Any]:
    register_initializer("NEIGHBOURS", _PairInitializer)
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)
    ctx.init_group([], "NEIGHBOURS", backend="gloo")
    out: dict[str, Any] = {"neighbours": ctx.get_ranks_in_group("NEIGHBOURS")}
    ctx.init_group([[0, 1]], ParallelMode.WEIGHT_TRANSFER, backend="gloo")
    if rank < 2:
        with pytest.raises(GroupRegistrationError) as dup:
            ctx.init_group([[1, 0]], ParallelMode.WEIGHT_TRANSFER, backend="gloo")
        out["duplicate"] = str(dup.value)
    else:  # every rank makes the same new_group calls; 2 and 3 are simply not members
        ctx.init_group([[1, 0]], ParallelMode.WEIGHT_TRANSFER, backend="gloo")
    with pytest.raises(NotImplementedError, match="GLOBAL"):
        ctx.init_group([0, 1], ParallelMode.GLOBAL, backend="gloo")
    with pytest.raises(BackendError, match="use backend='gloo'"):
        ctx.init_group([0, 1], ParallelMode.TRAIN_DATA_PARALLEL)  # seed default: nccl
    ctx.destroy()
    return out


@pytest.mark.integration
def test_user_initializer_duplicate_registration_and_backend_errors() -> None:
    results = run_ranks(_user_mode_and_errors, 4)
    assert results[2]["neighbours"] == [2, 3]
    assert results[0]["duplicate"] == (
        "rank 0 is already in WEIGHT_TRANSFER[0,1] and cannot also join WEIGHT_TRANSFER[1,0]: "
        "a rank belongs to at most one group per mode"
    )


def _destroy_and_reinit(rank: int, world_size: int) -> list[float]:
    sums = []
    for round_ in range(3):
        ctx = CommContext()
        ctx.init_distributed_env(backend="gloo", timeout=60)
        ctx.init_group([[0, 1], [2, 3]], ParallelMode.TRAIN_DATA_PARALLEL, backend="gloo")
        value = torch.tensor([float(rank + round_)])
        torch.distributed.all_reduce(value, group=ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL))
        sums.append(value.item())
        ctx.destroy()
    return sums


@pytest.mark.integration
def test_destroy_then_init_again_in_the_same_process() -> None:
    results = run_ranks(_destroy_and_reinit, 4)
    assert results[0] == [1.0, 3.0, 5.0]
    assert results[3] == [5.0, 7.0, 9.0]


@pytest.mark.integration
def test_group_timeout_is_passed_to_every_group() -> None:
    def check(rank: int, world_size: int) -> float:
        ctx = CommContext()
        ctx.init_distributed_env(backend="gloo", timeout=42)
        ctx.init_group([0, 1], ParallelMode.TRAIN_DATA_PARALLEL, backend="gloo")
        group = ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL)
        timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        ctx.destroy()
        return float(timeout)

    assert run_ranks(check, 2) == {0: 42.0, 1: 42.0}


def _derive_local_rank(rank: int, world_size: int) -> tuple[int, int]:
    del os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)
    ctx.init_group([[0, 1], [2, 3]], ParallelMode.INTRA_NODE, backend="gloo")
    derived = (ctx.get_in_node_rank(), ctx.get_local_world_size())
    ctx.destroy()
    return derived


@pytest.mark.integration
def test_local_rank_derived_from_intra_node_group() -> None:
    assert run_ranks(_derive_local_rank, 4) == {0: (0, 2), 1: (1, 2), 2: (0, 2), 3: (1, 2)}


def _init_groups_with_own_plan(rank: int, world_size: int) -> dict[str, Any]:
    from rlcomm import LayoutSpec, plan_layout

    # rank 1 was started with another layout: it must fail before any group is created
    rollouts = [2, 3] if rank != 1 else [3, 2]
    plan = plan_layout(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=rollouts))
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)
    try:
        ctx.init_groups(plan)
        return {"groups": sorted(ctx.describe())}
    except LayoutError as err:
        return {"error": str(err), "groups": sorted(ctx.describe())}
    finally:
        ctx.destroy()


@pytest.mark.integration
def test_a_rank_with_another_plan_fails_every_rank_before_any_group_exists() -> None:
    results = run_ranks(_init_groups_with_own_plan, 4, timeout=120)
    assert results[1]["error"].startswith("rank 1: its layout plan differs from rank 0's")
    for rank in (0, 2, 3):
        assert results[rank]["error"].startswith(
            f"rank {rank}: some ranks were started with another layout plan than rank 0's"
        )
    assert all(r["groups"] == ["GLOBAL"] for r in results.values())


def _init_groups_agreeing(rank: int, world_size: int) -> list[str]:
    from rlcomm import LayoutSpec, plan_layout

    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)
    ctx.init_groups(plan_layout(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=[2, 3])))
    groups = sorted(ctx.describe())
    ctx.destroy()
    return groups


@pytest.mark.integration
def test_init_groups_creates_every_planned_group() -> None:
    results = run_ranks(_init_groups_agreeing, 4)
    assert results[0] == ["GLOBAL", "INTER_NODE", "INTRA_NODE", "TRAIN_DATA_PARALLEL", "WEIGHT_TRANSFER"]
    assert results[2] == ["GLOBAL", "INTER_NODE", "INTRA_NODE", "WEIGHT_TRANSFER"]


