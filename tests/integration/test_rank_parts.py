"""Which parts a rank is built with (app/runtime/compose.py), as docs/how-a-rank-runs.md's table
says: on real gloo ranks, each layout's ranks get a collector, a trainer, a decider and a replay
server exactly where the plan gives them that job, and nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from app.api import JobInfo, RankEnv
from app.loops.dqn import DQNLoop
from app.loops.ppo import PPOLoop
from app.runtime.compose import build_rank
from app.runtime.membership.healing import live_checksum, settle
from rlcomm import LayoutSpec, ParallelMode, plan_layout
from rlcomm.testing import planned_context, run_ranks
from tests.helpers.shapes import shape_of

pytestmark = pytest.mark.integration

SMALL = {"num_envs": 2, "num_steps": 8}


def _parts(rank: int, world: int, spec: dict[str, Any], off_policy: bool,
           run_dir: str) -> dict[str, Any]:
    plan = plan_layout(LayoutSpec(world_size=world, **spec))
    loop: Any = (DQNLoop(hparams=SMALL, replay={"capacity": 64, "min_size": 16, "batch_size": 8})
                 if off_policy else PPOLoop(hparams=SMALL))
    with planned_context(plan, timeout=120) as ctx:
        job = JobInfo(plan=plan, run_dir=Path(run_dir), seed=1, rank=rank, env=RankEnv("local"),
                      shape=shape_of(plan, loop=loop), rollout_restarts=0)
        parts = build_rank(loop, ctx, job)
        parts.replay_link.begin(None, 0)  # as a run begins: a replay rank's server serves
        found = {
            "collector": parts.collector is not None,
            "trainer": parts.trainer is not None,
            "checkpointer": parts.checkpointer is not None,
            "decider": parts.deciders is not None,
            "deciders": parts.deciders.name if parts.deciders is not None else None,
            "replay server": parts.replay_link.server is not None,
            "hand-off": parts.hand_off.kind,
        }
        parts.replay_link.close()  # a replay server serves until every rank said STOP
        if parts.collector is not None:
            parts.collector.close()
        return found


def _table(found: dict[int, dict[str, Any]]) -> dict[int, tuple[str, ...]]:
    roles = ("collector", "trainer", "decider", "replay server")
    return {rank: tuple(r for r in roles if parts[r]) for rank, parts in found.items()}


@pytest.mark.parametrize(("layout", "spec", "expected", "deciders"), [
    ("elastic 2t2r", {"trainers": [0, 1], "elastic_rollouts": True},
     {0: ("trainer", "decider"), 1: ("trainer", "decider"), 2: ("collector",),
      3: ("collector",)}, ParallelMode.TRAIN_DATA_PARALLEL),
    ("static 2t2r", {"trainers": [0, 1], "elastic_rollouts": False},
     {0: ("trainer", "decider"), 1: ("trainer", "decider"), 2: ("collector", "decider"),
      3: ("collector", "decider")}, ParallelMode.GLOBAL),
    ("colocated", {"trainers": [0, 1, 2, 3], "rollouts": []},
     dict.fromkeys(range(4), ("collector", "trainer", "decider")), ParallelMode.GLOBAL),
])
def test_each_rank_has_the_parts_of_the_jobs_the_plan_gives_it(
    layout: str, spec: dict[str, Any], expected: dict[int, tuple[str, ...]],
    deciders: ParallelMode, tmp_path: Path,
) -> None:
    found = run_ranks(_parts, 4, spec, False, str(tmp_path), timeout=300)
    assert _table(found) == expected, (layout, found)
    assert all(found[r]["checkpointer"] == found[r]["trainer"] for r in found), found
    assert {found[r]["deciders"] for r in found if found[r]["decider"]} == {deciders.name}


@pytest.mark.parametrize(("elastic", "replay_decides"), [(False, True), (True, False)])
def test_a_replay_rank_serves_and_decides_only_beside_static_rollout_ranks(
    elastic: bool, replay_decides: bool, tmp_path: Path,
) -> None:
    spec = {"trainers": [0], "rollouts": [1, 2], "replay": [3], "elastic_rollouts": elastic}
    found = run_ranks(_parts, 4, spec, True, str(tmp_path), timeout=300)
    replay_rank = ("decider", "replay server") if replay_decides else ("replay server",)
    rollout = ("collector", "decider") if not elastic else ("collector",)
    assert _table(found) == {0: ("trainer", "decider"), 1: rollout, 2: rollout,
                             3: replay_rank}, found
    assert found[3]["hand-off"] == "replay", found


def _settled(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Elastic trainers of 2t2r built; trainer 1's weights made to differ (as a trainer that
    completed a collective the others did not would); every trainer settles."""
    plan = plan_layout(LayoutSpec(world_size=world, trainers=[0, 1]))
    loop = PPOLoop(hparams=SMALL)
    with planned_context(plan, timeout=120) as ctx:
        job = JobInfo(plan=plan, run_dir=Path(run_dir), seed=1, rank=rank, env=RankEnv("local"),
                      shape=shape_of(plan, loop=loop, elastic_trainers=None),
                      rollout_restarts=0)
        parts = build_rank(loop, ctx, job)
        found: dict[str, Any] = {"trainers": parts.trainers is not None}
        if parts.trainers is not None and parts.checkpointer is not None:
            if rank == 1:
                with torch.no_grad():
                    next(parts.agent.net.parameters()).add_(0.5)
                parts.state.update = 99  # its counters too
            found["before"] = live_checksum(parts.checkpointer)
            settle(ctx, parts.checkpointer, parts.state, lead=0)
            found["after"] = live_checksum(parts.checkpointer)
            found["update"] = parts.state.update
            parts.trainers.stop()
        if parts.collector is not None:
            parts.collector.close()
        return found


def test_trainers_whose_state_differs_after_a_change_heal_from_the_lead(tmp_path: Path) -> None:
    """app/runtime/membership/healing.py's settle: what follows an update during which the
    trainers changed (docs/failures.md, "What a survivor trains on")."""
    found = run_ranks(_settled, 4, str(tmp_path), timeout=300)
    assert [found[r]["trainers"] for r in range(4)] == [True, True, False, False]
    assert found[0]["before"] != found[1]["before"]
    assert found[0]["after"] == found[1]["after"] == found[0]["before"]
    assert found[0]["update"] == found[1]["update"] == 0  # the lead's counters, on both
