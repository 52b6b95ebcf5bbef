"""The sharded hand-offs send their large slices in place (app/runtime/handoff/weights_sharded.py,
static and elastic, over rlcomm.weights' direct tensors), on real gloo ranks: each owner sends
them from its own local shard (its send buffer holds none of them), and each rollout rank
receives them in lockstep straight into the whole weights it acts with (no receive buffer holds
them, the acting tensors keep their storage, nothing is copied into them). The weights stay exact and
verified (``verify_every=1``), in lockstep and with ``max_staleness``. (Elastic rollout ranks
fed by direct slices, one of them killed mid-run: tests/integration/
test_elastic_sharded_handoff.py, its ``direct`` cases.)

Every contiguous slice goes direct here (``DIRECT_MIN_BYTES = 0``, set in each rank), so the
small test policy takes the path a large one takes; tensor parallel's row-wise slices (not
contiguous) still travel packed beside them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from app.runtime.core.segments import Field, SegmentFormat
from app.runtime.handoff import HandOff, HandOffSettings, static_hand_off
from app.runtime.trainer.trained import TrainedModule
from rlcomm import LayoutSpec, plan_layout
from rlcomm.testing import planned_context, run_ranks
from tests.helpers.handoff_agent import Acting, sync_versions
from tests.helpers.shapes import shape_of

pytestmark = pytest.mark.integration

VERSIONS = 4
# A receive or send buffer without the direct slices holds a header, per-dtype padding and one
# checksum per slice: well under this beside the packed slices' own bytes.
OVERHEAD = 1024


def _direct_everywhere() -> None:
    import app.runtime.handoff.slices as slices

    slices.DIRECT_MIN_BYTES = 0


def _rollout_facts(hand_off: HandOff, agent: Acting) -> dict[str, int]:
    """How many direct slices the rollout rank's acting weights hold in place, of how many,
    and the bytes of the receive buffers beside them (and what they must hold: the packed)."""
    state = agent.state_dict()
    in_place = direct = packed = 0
    for _, slices, placements in hand_off.weights.receivers:
        for name, values in slices.slices().items():
            where = placements[name]
            if isinstance(where, slice) and values.numel():
                direct += 1
                in_place += values.data_ptr() == state[name].view(-1)[where].data_ptr()
            else:
                packed += values.nbytes
    return {"in_place": in_place, "direct": direct, "packed": packed,
            "buffers": sum(receiver.buffer_bytes for receiver, _, _ in hand_off.weights.receivers)}


def _static(rank: int, world: int, trainers: int, data_parallel: str, tensor: int | None,
            max_staleness: int) -> dict[str, Any]:
    _direct_everywhere()
    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(trainers)),
                                  tensor_parallel_size=tensor))
    with planned_context(plan, timeout=120) as ctx:
        torch.manual_seed(0)
        agent = Acting()
        trained = (TrainedModule(ctx, plan, agent.net, shape_of(plan, data_parallel))
                   if rank in plan.trainers else None)
        settings = HandOffSettings(max_staleness=max_staleness, verify_every=1, min_rollouts=1,
                                   timeout_s=120, episode_cap=1, sharded=True)
        hand_off = static_hand_off(ctx, plan, agent, SegmentFormat({"v": Field((1,), torch.int64)}),
                                   trained, settings)
        storage = {name: t.data_ptr() for name, t in agent.state_dict().items()}
        facts: list[dict[str, int]] = []

        def received() -> None:  # after each sync: what the rollout rank's weights hold
            facts.append({**_rollout_facts(hand_off, agent), "same_storage": int(
                storage == {n: t.data_ptr() for n, t in agent.state_dict().items()})})

        sent, held = sync_versions(hand_off, agent, trained, VERSIONS, received)
        sender = hand_off.weights.sender
        owned = hand_off.weights.owned.values() if hand_off.weights.owned is not None else {}
        return {"sent": sent, "held": held, "facts": facts,
                "send_buffer": sender.buffer_bytes if sender is not None else 0,
                "owned": sum(t.nbytes for t in owned.values())}


@pytest.mark.parametrize(("trainers", "grid", "max_staleness"), [
    (2, ("fsdp", None), 0), (2, ("fsdp", None), 2), (4, ("fsdp", 2), 0)])
def test_large_slices_go_from_the_owners_shards_straight_into_the_acting_weights(
    trainers: int, grid: tuple[str, int | None], max_staleness: int
) -> None:
    world = 2 * trainers  # the plan gives each trainer a rollout rank
    found = run_ranks(_static, world, trainers, *grid, max_staleness, timeout=300)
    whole = found[0]["sent"]
    for rank in range(trainers, world):
        held = found[rank]["held"]
        if max_staleness == 0:
            assert sorted(held) == list(range(1, VERSIONS + 1)), held.keys()
        for version, state in held.items():  # bit for bit, every entry (and verified)
            for name, values in state.items():
                assert np.array_equal(values, whole[version][name]), (rank, version, name)
        for facts in found[rank]["facts"]:
            assert facts["direct"] > 0, facts
            if max_staleness == 0:  # in place: the acting tensors are what was received into
                assert facts["in_place"] == facts["direct"], facts
                assert facts["same_storage"], facts
                # No receive buffer holds a direct slice: only the packed ones and headers.
                assert facts["buffers"] <= facts["packed"] + OVERHEAD * len(found), facts
            # (With max_staleness the next versions arrive beside the acting weights, as on
            # the flat path, and are copied in when swapped in.)
    whole_bytes = sum(v.nbytes for v in whole[1].values())
    for rank in range(trainers):
        # An owner's send buffer holds none of its direct slices (it sends from its shards),
        # let alone the whole model.
        if found[rank]["owned"]:
            assert found[rank]["send_buffer"] < found[rank]["owned"], found[rank]
        assert found[rank]["send_buffer"] < whole_bytes / trainers, found[rank]
