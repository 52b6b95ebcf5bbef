"""The runtime around any algorithm: an environment that fails mid-run, the normalisers'
statistics that travel with the weights and come back on resume (docs/environments.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.runtime.checkpoints.checkpoint import newest_valid_checkpoint
from tests.helpers.apprun import describe, metrics, read_result, run_app

SMALL = ("loop.hparams.num_envs=4", "loop.hparams.num_steps=64", "loop.progress=false")


@pytest.mark.e2e
def test_an_env_that_raises_on_one_rank_ends_the_run_naming_rank_env_and_exception(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    # Rank 3 (a rollout rank of 2t2r) fails in its 5th update; a checkpoint after every update.
    proc = run_app(*SMALL, "layout=2t2r", "loop.checkpoint_every=1", "loop.target_return=1e9",
                   "loop.env._target_=tests.helpers.failing_env.make_failing_env",
                   "+loop.env.kwargs.fail_rank=3", "+loop.env.kwargs.after_steps=300",
                   f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2, describe(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 3 exit code 1: EnvError: env CartPole-v1 "
                           "(tests.helpers.failing_env.make_failing_env) raised RuntimeError: "
                           "simulated fault after 300 steps"), describe(proc)
    # The last checkpoint is whole and verifies; the run can go on from it.
    picked = newest_valid_checkpoint(run_dir)
    assert picked.verified and not picked.skipped and picked.state["update"] >= 4
    # The other ranks, stopped by the agent's SIGTERM, may end their update with a checkpoint
    # (app/runtime/core/stopping.py): then result.json says so, never that the run went well.
    if (run_dir / "result.json").exists():
        assert read_result(run_dir)["status"] == "stopped", describe(proc)


@pytest.mark.e2e
def test_normaliser_statistics_travel_verified_and_a_resume_restores_them(tmp_path: Path) -> None:
    # Pendulum (Box actions) with both normalisers; every weights version verified by the
    # rollouts, so the statistics they act with are checked against the trainer's bytes.
    norm = ("loop.env.id=Pendulum-v1", "loop.env.normalize_obs=true",
            "loop.env.normalize_reward=true", "loop.verify_weights_every=1",
            "loop.checkpoint_every=1", "layout=1t1r", *SMALL)
    per_update = 4 * 64  # one rollout rank's observations per update
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    proc = run_app(*norm, f"loop.total_env_steps={2 * per_update}", f"hydra.run.dir={first}")
    assert proc.returncode == 0, describe(proc)
    state = newest_valid_checkpoint(first).state
    stats = state["normalizers"]
    assert set(stats) == {"obs_norm.mean", "obs_norm.var", "obs_norm.count",
                          "reward_norm.mean", "reward_norm.var", "reward_norm.count"}
    # The trainer folded in exactly what its rollout observed: 2 updates of 4 x 64 steps.
    assert float(stats["obs_norm.count"]) == pytest.approx(1e-4 + 2 * per_update, rel=1e-12)
    assert float(stats["reward_norm.count"]) == pytest.approx(1e-4 + 2 * per_update, rel=1e-12)
    assert torch.all(stats["obs_norm.var"] > 0) and stats["obs_norm.mean"].shape == (3,)

    proc = run_app(*norm, f"loop.total_env_steps={3 * per_update}", f"loop.resume={first}",
                   f"hydra.run.dir={resumed}")
    assert proc.returncode == 0, describe(proc)
    after = newest_valid_checkpoint(resumed).state["normalizers"]
    # Restored, then one more update folded in: the count goes on from the checkpoint's.
    assert float(after["obs_norm.count"]) == pytest.approx(1e-4 + 3 * per_update, rel=1e-12)
    assert not torch.equal(after["obs_norm.mean"], stats["obs_norm.mean"])
    assert read_result(resumed)["summary"]["env_steps"] == 3 * per_update
    assert len(metrics(resumed)) == 1  # another run dir: only this attempt's rows
