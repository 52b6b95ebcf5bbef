"""Asynchronous rollout with bounded staleness, through the app on real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.apprun import metrics, run_ppo
from tests.helpers.lockstep_trajectory import FIXTURE, REL_TOL, deviations, trajectory


@pytest.mark.e2e
def test_lockstep_reproduces_the_recorded_trajectory_within_cpu_rounding(tmp_path: Path) -> None:
    recorded = json.loads(FIXTURE.read_text())
    now = trajectory(tmp_path, "loop.max_staleness=0")
    off = deviations(now, recorded)
    more = [f"... and {len(off) - 12} more"] if len(off) > 12 else []
    assert not off, "\n".join([
        f"lockstep training no longer reproduces {FIXTURE.name} within {REL_TOL:g} relative "
        f"(another CPU strays 1e-4 at most), {len(off)} values:", *off[:12], *more])


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["2t2r", "1t3r"])
def test_one_version_of_staleness_reaches_the_target_with_the_bound_held(
    layout: str, tmp_path: Path
) -> None:
    # Seed 2 of 1t3r plateaued near a return of 250 while the value clip was centred on the
    # values the rollout recorded (docs/async-rollout.md, "What it costs, and what was wrong");
    # asynchronous PPO now solves seeds 0-19 there.
    result = run_ppo(tmp_path, f"layout={layout}", "loop.max_staleness=1", "seed=2",
                     "loop.checkpoint_every=0", "loop.verify_weights_every=5")
    trainers = [r["result"] for r in result["ranks"] if r["role"] == "trainer"]
    assert all(t["reached_target"] and t["mean_return_last_window"] >= 475 for t in trainers)
    rows = metrics(tmp_path)
    assert len(rows) == trainers[0]["updates"]
    assert all(0 <= r["staleness"] <= 1 for r in rows)  # the bound, on every update
    # Rollouts really collected ahead: after the first update the data is one version old
    # (unless a rollout was descheduled long enough for the next weights to arrive first).
    assert rows[0]["staleness"] == 0
    assert sum(r["staleness"] == 1 for r in rows[1:]) >= 0.8 * (len(rows) - 1)
    segments = (3 if layout == "1t3r" else 1) * len(rows)
    for trainer in trainers:
        assert trainer["max_staleness"] == 1
        assert sum(trainer["staleness_histogram"].values()) == segments
        assert set(trainer["staleness_histogram"]) <= {"0", "1"}
    # The budget counts every segment trained on, lagging or not; a rollout's segment collected
    # during the last update (k=1: at most one each) is neither trained on nor counted.
    assert result["summary"]["env_steps"] == len(rows) * (3 if layout == "1t3r" else 2) * 1024
    for rollout in (r["result"] for r in result["ranks"] if r["role"] == "rollout"):
        assert rollout["env_steps_collected"] - len(rows) * 1024 in (0, 1024), rollout
    assert all(0 <= r["result"]["wait_fraction"] < 1 for r in result["ranks"])
    waits = {"trainer_wait_s", "rollout_wait_s", "transfer_s", "wall_s", "return_window"}
    assert waits <= set(rows[0]) and all(r["rollout_wait_s"] >= 0 for r in rows)


