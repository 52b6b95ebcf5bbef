"""Mode-addressed collectives on 4 real gloo processes, with known numbers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlcomm import CommContext, ParallelMode
from rlcomm import collectives as C
from rlcomm.testing import run_ranks

pytestmark = pytest.mark.integration

TDP, WT = ParallelMode.TRAIN_DATA_PARALLEL, ParallelMode.WEIGHT_TRANSFER


def _collectives(rank: int, world_size: int) -> dict[str, Any]:
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)
    ctx.init_group([[0, 1], [2, 3]], TDP, backend="gloo")
    ctx.init_group([[3, 0], [2, 1]], WT, backend="gloo")  # leaders 3 and 2: higher than members
    out: dict[str, Any] = {}
    out["all_reduce"] = C.all_reduce(ctx, TDP, torch.tensor([float(rank)])).item()
    out["mean"] = C.all_reduce_dict(ctx, "GLOBAL", {"r": rank, "one": 1.0}, average=True)
    out["bcast_leader"] = C.broadcast(ctx, WT, torch.tensor([rank])).item()
    src = ctx.get_ranks_in_group(TDP)[1]  # the group's second member, addressed by group rank
    out["bcast_group_rank_1"] = C.broadcast(ctx, TDP, torch.tensor([rank]), src=src).item()
    out["group_rank"] = ctx.get_ranks_in_group(WT).index(rank)
    out["objects"] = C.broadcast_object_list(ctx, WT, [{"from": rank}])[0]
    out["all_gather"] = C.all_gather(ctx, TDP, torch.tensor([rank, 10 * rank])).tolist()
    gathered = C.gather(ctx, WT, torch.tensor([rank]))  # onto the leader
    out["gather"] = None if gathered is None else [t.item() for t in gathered]
    chunks = [torch.tensor([100 + i]) for i in range(2)] if rank in (2, 3) else None
    out["scatter"] = C.scatter(ctx, WT, torch.tensor([-1]), chunks).item()
    C.barrier(ctx, TDP)
    out["json"] = C.gather_json(ctx, "GLOBAL", {"rank": rank, "name": "é" * rank}, dst=0)
    # all_to_all with autograd: member i sends row j to member j; grads flow back.
    x = torch.tensor([[10.0 * rank], [10.0 * rank + 1]], requires_grad=True)
    y = C.all_to_all(ctx, TDP, x)
    (y * torch.tensor([[1.0], [2.0]])).sum().backward()
    out["a2a"], out["a2a_grad"] = y.detach().flatten().tolist(), x.grad.flatten().tolist()  # type: ignore[union-attr]
    ctx.destroy()
    return out


def test_collectives_give_the_right_numbers() -> None:
    r = run_ranks(_collectives, 4)
    assert [r[i]["all_reduce"] for i in range(4)] == [1.0, 1.0, 5.0, 5.0]
    assert r[1]["mean"] == {"one": 1.0, "r": 1.5}
    assert [r[i]["bcast_leader"] for i in range(4)] == [3, 2, 2, 3]
    assert [r[i]["bcast_group_rank_1"] for i in range(4)] == [1, 1, 3, 3]
    assert [r[i]["group_rank"] for i in range(4)] == [0, 0, 1, 1]  # sorted: leader is last
    assert r[0]["objects"] == {"from": 3}
    assert r[2]["all_gather"] == [2, 20, 3, 30]
    assert r[3]["gather"] == [0, 3] and r[2]["gather"] == [1, 2] and r[0]["gather"] is None
    # scatter chunks go in group-rank (sorted) order: the member (0 or 1) gets chunk 0.
    assert [r[i]["scatter"] for i in range(4)] == [100, 100, 101, 101]
    assert r[0]["json"] == [{"rank": i, "name": "é" * i} for i in range(4)]
    assert r[1]["json"] is None
    assert r[0]["a2a"] == [0.0, 10.0] and r[1]["a2a"] == [1.0, 11.0]
    assert r[0]["a2a_grad"] == [1.0, 1.0] and r[1]["a2a_grad"] == [2.0, 2.0]
