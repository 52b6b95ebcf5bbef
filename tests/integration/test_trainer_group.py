"""The trainers' membership (app/runtime/trainer/) on real gloo processes over 127.0.0.1,
sharing a store this process hosts (tests/helpers/store_processes.py): a collective over
TRAIN_DATA_PARALLEL that a lost trainer broke runs again on the survivors' next epoch, with three
trainers; gradients are averaged over the live trainers, and a step whose average a loss broke
is averaged again over the survivors, never a mix of two groups. The whole app's
trainer losses and heals are tests/e2e/test_elastic_trainers.py.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch
from torch import distributed as dist
from torch import nn

from app.runtime.membership.trainers import TrainerGroup
from app.runtime.trainer.gradients import AveragedGradients
from rlcomm import CommContext, ParallelMode, collectives
from tests.helpers.store_processes import meet, run_processes

pytestmark = pytest.mark.integration

TDP = ParallelMode.TRAIN_DATA_PARALLEL
TRAINERS = [0, 1, 2]
PATIENCE = datetime.timedelta(seconds=20)  # a loss is noticed at once: this only bounds a hang
LOST = 2
CODE = 9  # the lost trainer's exit code


def _group(rank: int, store: dist.Store, adopted: list[int]) -> tuple[CommContext, TrainerGroup]:
    ctx = CommContext()
    ctx.join_running_job(store, rank, len(TRAINERS), 60)  # a store, no default group
    group = TrainerGroup(ctx, TRAINERS, {}, PATIENCE, adopted.extend)
    group.begin()
    return ctx, group


def _collective_after_a_loss(rank: int, store: dist.Store) -> dict[str, Any]:
    adopted: list[int] = []
    ctx, group = _group(rank, store, adopted)
    before = collectives.all_reduce(ctx, TDP, torch.tensor([float(rank + 1)])).item()
    meet(store, "test/reduced", len(TRAINERS))
    if rank == LOST:
        os._exit(CODE)  # as a killed process: its connections close, its heartbeat stops
    after = collectives.all_reduce(ctx, TDP, torch.tensor([float(rank + 1)])).item()
    group.stop()
    return {"before": before, "after": after, "epoch": group.epoch, "members": group.members,
            "changes": [c.record() for c in group.changes], "adopted": adopted}


def test_a_collective_a_lost_trainer_broke_runs_again_on_the_survivors() -> None:
    results = run_processes(_collective_after_a_loss, len(TRAINERS), exits={LOST: CODE})
    for rank in (0, 1):
        assert results[rank]["before"] == 6.0  # 1 + 2 + 3, the planned trainers
        assert results[rank]["after"] == 3.0  # 1 + 2: the survivors' epoch, the same call
        assert (results[rank]["epoch"], results[rank]["members"]) == (1, [0, 1])
        assert results[rank]["adopted"] == []  # it led no rollout ranks
    (leave,) = results[0]["changes"]  # the lead's record
    assert (leave["event"], leave["rank"], leave["reason"], leave["epoch"]) == \
        ("leave", LOST, "killed", 1), leave
    assert results[1]["changes"] == []


class Line(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, -2.0]))


def _data(rank: int, step: int) -> torch.Tensor:
    return torch.tensor([float(rank + 1) * (step + 1), 0.5 * rank - step])


def _steps_across_a_loss(rank: int, store: dist.Store) -> dict[str, Any]:
    ctx, group = _group(rank, store, [])
    model = Line()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    AveragedGradients(ctx, optimizer)

    def step(index: int) -> None:
        optimizer.zero_grad()
        (model.weight * _data(rank, index)).sum().backward()
        optimizer.step()

    step(0)  # every trainer
    meet(store, "test/stepped", len(TRAINERS))
    if rank == LOST:
        os._exit(CODE)
    start = model.weight.detach().clone()
    step(1)  # its average fails, and runs again over the survivors before the step
    group.stop()
    return {"weight": model.weight.detach().tolist(), "start": start.tolist(),
            "epoch": group.epoch}


def test_a_step_whose_average_a_lost_trainer_broke_is_averaged_over_the_survivors() -> None:
    results = run_processes(_steps_across_a_loss, len(TRAINERS), exits={LOST: CODE})
    first = torch.tensor([1.0, -2.0]) - 0.1 * sum(_data(r, 0) for r in TRAINERS) / 3
    second = first - 0.1 * (_data(0, 1) + _data(1, 1)) / 2  # never a mix with rank 2's
    for rank in (0, 1):
        assert results[rank]["epoch"] == 1
        assert torch.allclose(torch.tensor(results[rank]["start"]), first)
        assert torch.allclose(torch.tensor(results[rank]["weight"]), second), results[rank]
