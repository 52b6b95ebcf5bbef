"""The sharded hand-off's shard senders are steady (app/runtime/handoff/sharded.py, rlcomm.weights'
``steady``), on real gloo ranks: with FSDP2 every slice of an owner is direct, so a version that
``verify_every`` does not checksum costs each owner's group one broadcast per slice and no header
message, a checksummed one a message more; the rollout ranks take part in exactly those
broadcasts and act with the exact whole weights, in lockstep and with ``max_staleness``.

Every contiguous slice goes direct here (``DIRECT_MIN_BYTES = 0``, set in each rank), so the
small test policy takes the path a large one takes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from app.runtime.handoff import HandOffSettings
from app.runtime.handoff.sharded import ShardedHandOff, shards_mode
from app.runtime.segments import Field, SegmentFormat
from app.runtime.sharding import TrainedModule
from rlcomm import CommContext, LayoutSpec, plan_layout
from rlcomm.testing import planned_context, run_ranks
from tests.helpers.handoff_agent import Acting, state_values

pytestmark = pytest.mark.integration

VERSIONS = 5
EVERY = 2  # versions 2 and 4 are checksummed; 3 and 5 are routine
TRAINERS = 2


def _entered(ctx: CommContext, modes: list[str]) -> int:
    table = ctx.recorder.table()
    return sum(int(table.get(mode, {}).get("entered", 0)) for mode in modes)


def _ranks(rank: int, world: int, max_staleness: int) -> dict[str, Any]:
    import app.runtime.handoff.sharded as sharded

    sharded.DIRECT_MIN_BYTES = 0
    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(TRAINERS))))
    with planned_context(plan, timeout=120) as ctx:
        torch.manual_seed(0)
        agent = Acting()
        trainer = rank in plan.trainers
        trained = TrainedModule(ctx, plan, agent.net, "fsdp") if trainer else None
        settings = HandOffSettings(max_staleness=max_staleness, verify_every=EVERY,
                                   min_rollouts=1, timeout_s=120, episode_cap=1, sharded=True)
        hand_off = ShardedHandOff(ctx, plan, agent, SegmentFormat({"v": Field((1,), torch.int64)}),
                                  trained, settings)
        modes = [shards_mode(owner) for owner in hand_off.owners]
        if trainer:
            modes = [shards_mode(rank)] if rank in hand_off.owners else []
        counts: list[int] = []
        sent: dict[int, dict[str, np.ndarray]] = {}
        held: dict[int, dict[str, np.ndarray]] = {}
        for version in range(1, VERSIONS + 1):
            if trained is not None:  # a new version of every shard, as an update makes
                hand_off.before_optimizer_step()
                with torch.no_grad():
                    for param in trained.trained.parameters():
                        param.add_(0.01 * version)
                    agent.stats.add_(version)
                trained.publish()
                sent[version] = state_values(agent)
            before = _entered(ctx, modes)
            hand_off.sync_weights(first=version == 1)
            counts.append(_entered(ctx, modes) - before)
            if not trainer:
                held[hand_off.version(0)] = state_values(agent)
        hand_off.before_optimizer_step()
        owned = hand_off.owned.values() if hand_off.owned is not None else {}
        return {"counts": counts, "sent": sent, "held": held,
                "slices": sum(1 for t in owned.values() if t.numel()),
                "total": _entered(ctx, modes)}


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_routine_versions_cost_one_broadcast_per_direct_slice(max_staleness: int) -> None:
    world = 2 * TRAINERS  # the plan gives each trainer a rollout rank
    found = run_ranks(_ranks, world, max_staleness, timeout=300)
    owners = [rank for rank in range(TRAINERS) if found[rank]["slices"]]
    assert owners == list(range(TRAINERS)), found  # FSDP2: every trainer owns slices
    for rank in owners:
        slices, counts = found[rank]["slices"], found[rank]["counts"]
        # Checksummed (2, 4): the header message and each slice; routine (3, 5): each slice.
        assert counts[1:] == [slices + 1, slices, slices + 1, slices], (rank, slices, counts)
    for rank in range(TRAINERS, world):
        # The rollout rank took part in exactly the owners' broadcasts, on every group.
        assert found[rank]["total"] == sum(found[r]["total"] for r in owners), found[rank]
        held = found[rank]["held"]
        if max_staleness == 0:
            assert sorted(held) == list(range(1, VERSIONS + 1)), held.keys()
        assert max(held) >= VERSIONS - max_staleness, held.keys()
        for version, state in held.items():  # bit for bit, every entry
            for name, values in state.items():
                assert np.array_equal(values, found[0]["sent"][version][name]), (version, name)
