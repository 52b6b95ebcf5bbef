"""Elastic rollout ranks fed by sharded trainers (app/runtime/handoff/weights_sharded.py), on
real gloo ranks: FSDP2 over two trainers, each leading one elastic rollout rank. Every rollout
rank acts with the whole model's exact weights, assembled from the owners' slices, and no
trainer gathers the model to send it; a rollout rank SIGKILLed mid-run is dropped, and the job
goes on with the survivor, which still gets every owner's verified slices. (A killed rollout rank
that rejoins: tests/e2e/test_sharded_runs.py, through ``python -m app``.) The ``direct`` cases
send every contiguous slice on its own, from the owner's shard straight into the rollout rank's
whole weights (``DIRECT_MIN_BYTES = 0``: the path a large policy's slices take)."""

from __future__ import annotations

import datetime
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from app.api import JobInfo, RankEnv
from app.runtime.core.segments import Field, SegmentFormat, with_episodes
from app.runtime.handoff import HandOff, HandOffSettings, build_hand_off
from app.runtime.trainer.trained import TrainedModule
from rlcomm import CommContext, LayoutSpec, plan_layout
from rlcomm.testing import planned_context, run_ranks
from tests.helpers.handoff_agent import Acting, state_values
from tests.helpers.shapes import shape_of

pytestmark = pytest.mark.integration

TRAINERS, ROLLOUTS = 2, 2  # trainer 0 leads rollout rank 2, trainer 1 rollout rank 3
UPDATES = 6
VICTIM, KILL_AT = 3, 2  # SIGKILLed once it acts with weights version 2
SEGMENT_FORMAT = with_episodes(SegmentFormat({"version": Field((1,), torch.int64)}), 1)


def _direct_everywhere() -> None:
    import app.runtime.handoff.slices as slices

    slices.DIRECT_MIN_BYTES = 0


def _setup(rank: int, world: int, ctx: Any, max_staleness: int = 0
           ) -> tuple[Acting, TrainedModule | None, HandOff]:
    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(TRAINERS)),
                                  elastic_rollouts=True))
    torch.manual_seed(0)
    agent = Acting()
    shape = shape_of(plan, "fsdp")
    trained = TrainedModule(ctx, plan, agent.net, shape) if rank in plan.trainers else None
    job = JobInfo(plan=plan, run_dir=Path("."), seed=0, rank=rank, env=RankEnv("local"),
                  shape=shape, rollout_restarts=0)
    settings = HandOffSettings(max_staleness=max_staleness, verify_every=1, min_rollouts=1,
                               timeout_s=60, episode_cap=1, sharded=True, rollout_restarts=0)
    return agent, trained, build_hand_off(ctx, job, agent, SEGMENT_FORMAT, trained, settings)


def _plan(world: int) -> Any:
    return plan_layout(LayoutSpec(world_size=world, trainers=list(range(TRAINERS)),
                                  elastic_rollouts=True))


def _trainer(agent: Acting, trained: TrainedModule, hand_off: HandOff) -> dict[str, Any]:
    """The run loop's trainer side, each update a new version of every shard; counts the
    whole-tensor gathers on the send path (DTensor.full_tensor while sending)."""
    from torch.distributed.tensor import DTensor

    sending, gathers = [False], {"send": 0, "publish": 0}
    original = DTensor.full_tensor

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        gathers["send" if sending[0] else "publish"] += 1
        return original(self, *args, **kwargs)

    DTensor.full_tensor = spy  # type: ignore[method-assign]

    def sync(first: bool) -> None:
        sending[0] = True
        hand_off.sync_weights(first=first)
        sending[0] = False
        sent[hand_off.version(0)] = state_values(agent)

    sent: dict[int, dict[str, np.ndarray]] = {}
    sync(first=True)
    for update in range(UPDATES):
        if update:
            sync(first=False)
        hand_off.exchange(None, [], update)
        sending[0] = True
        hand_off.before_optimizer_step()
        sending[0] = False
        with torch.no_grad():
            for param in trained.trained.parameters():
                param.add_(0.01 * (update + 1))
            agent.stats.add_(update + 1)
        trained.publish()
        hand_off.update_done()
    hand_off.stop(UPDATES, 0)
    return {"sent": sent, "gathers": gathers, "bytes": hand_off.stats.weight_bytes_sent,
            "kind": hand_off.kind, "result": hand_off.result(),
            "shard_bytes": hand_off.weights.weight_bytes}


def _rollout(agent: Acting, hand_off: HandOff, report: Any = None) -> dict[str, Any]:
    """The run loop's rollout side until its trainer stops it; ``report``: told each version."""
    held: dict[int, dict[str, np.ndarray]] = {}
    going, update = hand_off.sync_weights(first=True), 0
    while going:
        version = hand_off.version(update)
        held[version] = state_values(agent)
        if report is not None:
            report(version)
        own = SEGMENT_FORMAT.empty()
        SEGMENT_FORMAT.unpack(own)["version"][0] = version
        if hand_off.exchange(own, [], update) is None:
            break
        update += 1
        going = hand_off.sync_weights(first=False)
    return {"held": held, "kind": hand_off.kind, "result": hand_off.result()}


def _rank(rank: int, world: int, max_staleness: int, direct: bool) -> dict[str, Any]:
    if direct:
        _direct_everywhere()
    with planned_context(_plan(world), timeout=60) as ctx:
        agent, trained, hand_off = _setup(rank, world, ctx, max_staleness)
        if trained is not None:
            return _trainer(agent, trained, hand_off)
        return _rollout(agent, hand_off)


def _surviving_rank(rank: int, world: int) -> dict[str, Any]:
    """As :func:`_rank`, without the context's teardown: its barrier over every rank would
    wait for the killed one (the process ends with os._exit, as the app's ranks do)."""
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)
    ctx.init_groups(_plan(world))
    agent, trained, hand_off = _setup(rank, world, ctx)
    survivors = [r for r in range(TRAINERS, world) if r != VICTIM]
    if trained is None:
        found = _rollout(agent, hand_off)
        ctx.store.set(f"test/ended/{rank}", "1")
        return found
    found = _trainer(agent, trained, hand_off)
    # Rank 0 holds the store: it stays until the survivors read their last records from it.
    if rank == 0:
        ctx.store.wait([f"test/ended/{r}" for r in survivors], datetime.timedelta(seconds=60))
    return found


def _rank_with_victim(rank: int, world: int, direct: bool) -> dict[str, Any]:
    """As :func:`_rank`; rank VICTIM runs in a child process that is SIGKILLed mid-run (its
    connections close, as a crashed host's process's do), and reports the versions it held."""
    if direct:
        _direct_everywhere()
    if rank != VICTIM:
        return _surviving_rank(rank, world)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the rollout rank itself
        os.close(read)

        def report(version: int) -> None:
            os.write(write, bytes([version]))

        try:
            ctx = CommContext()
            ctx.init_distributed_env(backend="gloo", timeout=60)
            ctx.init_groups(_plan(world))
            agent, _, hand_off = _setup(rank, world, ctx)
            _rollout(agent, hand_off, report)
        finally:
            os._exit(1)  # only the kill should end it
    os.close(write)
    seen: list[int] = []
    while KILL_AT not in seen:
        chunk = os.read(read, 16)
        assert chunk, f"rank {rank} ended before version {KILL_AT}: {seen}"
        seen += list(chunk)
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    return {"killed_after": seen}


def _assert_exact(found: dict[int, dict[str, Any]], rollout: int) -> None:
    whole, held = found[0]["sent"], found[rollout]["held"]
    assert held, rollout
    for version, state in held.items():  # bit for bit, every entry (and verified on arrival)
        assert state.keys() == whole[version].keys()
        for name, tensor in state.items():
            assert np.array_equal(tensor, whole[version][name]), (rollout, version, name)


@pytest.mark.parametrize(("max_staleness", "direct"), [(0, False), (2, False), (0, True)])
def test_elastic_rollout_ranks_of_fsdp2_trainers_act_with_the_exact_whole_weights(
    max_staleness: int, direct: bool
) -> None:
    found = run_ranks(_rank, TRAINERS + ROLLOUTS, max_staleness, direct, timeout=300)
    assert {found[r]["kind"] for r in found} == {"elastic-sharded"}
    for rank in range(1, TRAINERS):  # every trainer published the same whole weights
        assert all(np.array_equal(found[0]["sent"][v][k], found[rank]["sent"][v][k])
                   for v in found[0]["sent"] for k in found[0]["sent"][v])
    for rollout in range(TRAINERS, TRAINERS + ROLLOUTS):
        if max_staleness == 0:  # lockstep: every version, in order
            assert sorted(found[rollout]["held"]) == list(range(1, UPDATES + 1))
        _assert_exact(found, rollout)
    # No trainer gathers the model to send it: nothing on the send path calls full_tensor
    # (publishing the acting module does), and each owner sends its own shard only: together
    # the whole weights once per version to each rollout rank.
    for trainer in range(TRAINERS):
        gathers = found[trainer]["gathers"]
        assert gathers["send"] == 0 and gathers["publish"] > 0, gathers
    total = sum(t.nbytes for t in found[0]["sent"][1].values())
    shards = [found[r]["shard_bytes"] for r in range(TRAINERS)]
    assert sum(shards) == total and max(shards) < total, (shards, total)
    assert [found[r]["bytes"] for r in range(TRAINERS)] == [
        UPDATES * ROLLOUTS * s for s in shards]


@pytest.mark.parametrize("direct", [False, True])
def test_a_rollout_rank_killed_under_fsdp2_trainers_is_dropped_and_the_survivor_goes_on(
    direct: bool,
) -> None:
    found = run_ranks(_rank_with_victim, TRAINERS + ROLLOUTS, direct, timeout=300)
    survivor = 2  # trainer 0's
    assert KILL_AT in found[VICTIM]["killed_after"]
    # Its trainer dropped it; both trainers formed a new epoch (the job's shard groups are
    # every trainer's) and trained every update.
    leader = VICTIM - TRAINERS
    changes = found[leader]["result"]["changes"]
    assert [(c["event"], c["rank"]) for c in changes] == [("leave", VICTIM)], changes
    assert found[leader]["result"]["members"] == []
    for trainer in range(TRAINERS):
        assert found[trainer]["result"]["epoch"] == 1, found[trainer]["result"]
    # The survivor acted with every owner's slices, exact, before and after the change, to
    # the end of the run.
    held = found[survivor]["held"]
    assert sorted(held) == list(range(1, UPDATES + 1)), sorted(held)
    _assert_exact(found, survivor)
    assert found[survivor]["result"]["epoch"] == 1
