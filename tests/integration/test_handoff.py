"""The hand-off (app/runtime/handoff/): the run's shape picks its implementation, and the sharded one
delivers, on real gloo ranks, the whole model's exact weights to every rollout rank from the
trainers' shards (FSDP2, tensor parallel under ``replicate``, both), in lockstep and with
``max_staleness``, each element sent by one trainer only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.api import JobInfo, RankEnv
from app.runtime.core.segments import Field, SegmentFormat
from app.runtime.handoff import HandOffSettings, build_hand_off, static_hand_off
from app.runtime.trainer.trained import TrainedModule
from rlcomm import LayoutSpec, plan_layout
from rlcomm.testing import planned_context, run_ranks
from tests.helpers.handoff_agent import Acting, sync_versions
from tests.helpers.shapes import shape_of

pytestmark = pytest.mark.integration

TRAINERS, ROLLOUTS = 4, 4  # the plan gives each trainer a rollout rank
GRIDS = {"fsdp4": ("fsdp", None), "tp2-ddp2": ("ddp", 2), "tp2-fsdp2": ("fsdp", 2)}
VERSIONS = 4


def _settings(max_staleness: int, sharded: bool) -> HandOffSettings:
    return HandOffSettings(max_staleness=max_staleness, verify_every=1, min_rollouts=1,
                           timeout_s=120, episode_cap=1, sharded=sharded)


def _hand_off(rank: int, world: int, data_parallel: str, tensor: int | None,
              max_staleness: int) -> dict[str, Any]:
    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(TRAINERS)),
                                  tensor_parallel_size=tensor))
    with planned_context(plan, timeout=120) as ctx:
        torch.manual_seed(0)
        agent = Acting()
        trained = (TrainedModule(ctx, plan, agent.net, shape_of(plan, data_parallel))
                   if rank in plan.trainers else None)
        hand_off = static_hand_off(ctx, plan, agent, SegmentFormat({"v": Field((1,), torch.int64)}),
                                   trained, _settings(max_staleness, sharded=True))
        sent, held = sync_versions(hand_off, agent, trained, VERSIONS)
        return {"sent": sent, "held": held, "owners": hand_off.weights.owners,
                "bytes": hand_off.stats.weight_bytes_sent, "kind": hand_off.kind}


@pytest.mark.parametrize(("grid", "max_staleness"), [
    ("fsdp4", 0), ("tp2-ddp2", 0), ("tp2-fsdp2", 0), ("tp2-fsdp2", 2)])
def test_rollout_ranks_assemble_the_whole_models_exact_weights_from_the_shards(
    grid: str, max_staleness: int
) -> None:
    data_parallel, tensor = GRIDS[grid]
    found = run_ranks(_hand_off, TRAINERS + ROLLOUTS, data_parallel, tensor, max_staleness,
                      timeout=300)
    whole = found[0]["sent"]
    for rank in range(1, TRAINERS):  # every trainer published the same whole weights
        assert all(np.array_equal(whole[v][k], found[rank]["sent"][v][k])
                   for v in whole for k in whole[v])
    for rank in range(TRAINERS, TRAINERS + ROLLOUTS):
        held = found[rank]["held"]
        assert held, rank
        if max_staleness == 0:  # lockstep: every version, in order
            assert sorted(held) == list(range(1, VERSIONS + 1)), held.keys()
        for version, state in held.items():  # bit for bit, every entry, whatever arrived
            assert state.keys() == whole[version].keys()
            for name, tensor_ in state.items():
                assert np.array_equal(tensor_, whole[version][name]), (rank, version, name)
    # Each element left one trainer: together the trainers sent the whole weights once per
    # version to each rollout rank.
    total = sum(t.nbytes for t in whole[1].values())
    assert sum(found[r]["bytes"] for r in range(TRAINERS)) == VERSIONS * ROLLOUTS * total
    if data_parallel == "ddp":  # under replicate, the first replica's ranks send
        assert found[0]["owners"] == [0, 1], found[0]["owners"]
    else:
        assert found[0]["owners"] == list(range(TRAINERS))


def _chosen(rank: int, world: int, elastic: bool, data_parallel: str) -> str:
    plan = plan_layout(LayoutSpec(world_size=world, trainers=[0], elastic_rollouts=elastic))
    with planned_context(plan, timeout=120) as ctx:
        torch.manual_seed(0)
        agent = Acting()
        shape = shape_of(plan, data_parallel)
        trained = TrainedModule(ctx, plan, agent.net, shape) if rank == 0 else None
        job = JobInfo(plan=plan, run_dir=Path("."), seed=0, rank=rank, env=RankEnv("local"),
                      shape=shape)
        segment_format = SegmentFormat({"version": Field((1,), torch.int64)})
        return build_hand_off(ctx, job, agent, segment_format, trained,
                              _settings(0, shape.shards_weights)).kind


@pytest.mark.parametrize(("elastic", "data_parallel", "kind"), [
    (False, "ddp", "flat"), (False, "fsdp", "sharded"), (True, "ddp", "elastic"),
    (True, "fsdp", "elastic-sharded")])
def test_the_plan_picks_the_hand_off(elastic: bool, data_parallel: str, kind: str) -> None:
    assert set(run_ranks(_chosen, 2, elastic, data_parallel, timeout=120).values()) == {kind}
