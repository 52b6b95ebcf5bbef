"""CommContext in this process, before any group exists: the backend it picks, and the one
clear error for nccl without CUDA, a missing or bad launcher variable, and a plan of another
world size. Its methods on real ranks are tests/integration/test_context.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlcomm import BackendError, CommContext, EnvironmentConfigError, LayoutError, ParallelMode

pytestmark = pytest.mark.unit


def test_nccl_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error is for machines without it")
    with pytest.raises(
        BackendError, match="needs CUDA devices but none are visible.*use backend='gloo'"
    ):
        CommContext().init_distributed_env(1, 0, backend="nccl")
    assert not CommContext().is_initialized()


def test_auto_backend_picks_gloo_without_cuda() -> None:
    from rlcomm import resolve_backend

    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    with pytest.raises(BackendError, match="'mpi' is not one of nccl, gloo, auto"):
        resolve_backend("mpi")


@pytest.mark.parametrize(
    ("env", "kwargs", "message"),
    [
        ({}, {}, "environment variable WORLD_SIZE is not set"),
        ({"WORLD_SIZE": "2"}, {}, "environment variable RANK is not set"),
        ({"WORLD_SIZE": "two"}, {}, "WORLD_SIZE='two' is not an integer"),
        ({}, {"world_size": 2, "rank": 5}, "rank 5 is out of range for world_size 2"),
        ({}, {"world_size": 2, "rank": 0, "timeout": 0}, "timeout must be a positive number"),
    ],
)
def test_environment_errors_name_the_variable(
    env: dict[str, str], kwargs: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises((EnvironmentConfigError, ValueError), match=message):
        CommContext().init_distributed_env(backend="gloo", **kwargs)


def test_local_rank_missing_is_a_clear_error_not_a_type_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    ctx = CommContext()
    with pytest.raises(EnvironmentConfigError, match="LOCAL_RANK is not set and cannot be derived"):
        ctx.get_in_node_rank()
    with pytest.raises(EnvironmentConfigError, match="LOCAL_WORLD_SIZE is not set"):
        ctx.get_local_world_size()


def test_init_groups_needs_a_plan_of_the_joined_world_size() -> None:
    from rlcomm import LayoutSpec, plan_layout

    ctx = CommContext()
    ctx.init_distributed_env(8, 0, backend="fake", timeout=60)
    try:
        with pytest.raises(LayoutError, match="the plan has 4 ranks but init_distributed_env joined 8"):
            ctx.init_groups(plan_layout(LayoutSpec(world_size=4, trainers=[0, 1, 2, 3])))
        with pytest.raises(LayoutError, match="SEQUENCE_PARALLEL: group_size needs tensor_parallel_size"):
            ctx.init_group(list(range(8)), ParallelMode.SEQUENCE_PARALLEL, backend="gloo", group_size=2)
    finally:
        ctx.destroy()
