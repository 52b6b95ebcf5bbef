"""The sharded hand-off's shard senders are steady (app/runtime/handoff/weights_sharded.py, rlcomm.weights'
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

from app.runtime.core.segments import Field, SegmentFormat
from app.runtime.handoff import HandOffSettings, static_hand_off
from app.runtime.handoff.slices import shards_mode
from app.runtime.trainer.trained import TrainedModule
from rlcomm import CommContext, LayoutSpec, plan_layout
from rlcomm.testing import planned_context, run_ranks
from tests.helpers.handoff_agent import Acting, sync_versions
from tests.helpers.shapes import shape_of

pytestmark = pytest.mark.integration

VERSIONS = 5
EVERY = 2  # versions 2 and 4 are checksummed; 3 and 5 are routine
CHECKSUMMED = [2, 4]
TRAINERS = 2


def _entered(ctx: CommContext, modes: list[str]) -> int:
    table = ctx.recorder.table()
    return sum(int(table.get(mode, {}).get("entered", 0)) for mode in modes)


def _ranks(rank: int, world: int, max_staleness: int) -> dict[str, Any]:
    import app.runtime.handoff.slices as slices

    slices.DIRECT_MIN_BYTES = 0
    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(TRAINERS))))
    with planned_context(plan, timeout=120) as ctx:
        torch.manual_seed(0)
        agent = Acting()
        trainer = rank in plan.trainers
        trained = TrainedModule(ctx, plan, agent.net, shape_of(plan, "fsdp")) if trainer else None
        settings = HandOffSettings(max_staleness=max_staleness, verify_every=EVERY,
                                   min_rollouts=1, timeout_s=120, episode_cap=1, sharded=True)
        hand_off = static_hand_off(ctx, plan, agent, SegmentFormat({"v": Field((1,), torch.int64)}),
                                   trained, settings)
        modes = [shards_mode(owner) for owner in hand_off.weights.owners]
        if trainer:
            modes = [shards_mode(rank)] if rank in hand_off.weights.owners else []
        counts: list[int] = []  # a rollout rank's broadcasts per sync, on every owner's group

        def received() -> None:
            counts.append(_entered(ctx, modes) - sum(counts))

        sent, held = sync_versions(hand_off, agent, trained, VERSIONS, received)
        owned = hand_off.weights.owned.values() if hand_off.weights.owned is not None else {}
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
        # Version 1: its header, the metadata, the agreement and the buffers (4), then each of
        # its slices every version, and a header message more on a checksummed one.
        mine = found[rank]["slices"]
        assert found[rank]["total"] == 4 + VERSIONS * mine + len(CHECKSUMMED), (rank, mine)
    slices = sum(found[rank]["slices"] for rank in owners)
    for rank in range(TRAINERS, world):
        # The rollout rank took part in exactly the owners' broadcasts, on every group.
        assert found[rank]["total"] == sum(found[r]["total"] for r in owners), found[rank]
        if max_staleness == 0:  # one version per sync: checksummed (2, 4) carry each owner's
            # header message beside its slices; routine ones (3, 5) only the slices.
            want = [slices + len(owners), slices, slices + len(owners), slices]
            assert found[rank]["counts"][1:] == want, (found[rank]["counts"], slices)
        held = found[rank]["held"]
        if max_staleness == 0:
            assert sorted(held) == list(range(1, VERSIONS + 1)), held.keys()
        assert max(held) >= VERSIONS - max_staleness, held.keys()
        for version, state in held.items():  # bit for bit, every entry
            for name, values in state.items():
                assert np.array_equal(values, found[0]["sent"][version][name]), (version, name)
