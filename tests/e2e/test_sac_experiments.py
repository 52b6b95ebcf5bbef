"""``python -m app +experiment=halfcheetah_sac`` as a user runs it, cut to a few hundred env
steps with a tiny replay: MuJoCo HalfCheetah-v5 collects, fills the replay, and SAC's learner
steps at the experiment's ratio before the run ends (docs/off-policy.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.apprun import describe, metrics, read_result, run_app

pytestmark = pytest.mark.e2e

# 384 env steps (12 updates of 4 envs x 8 steps), learning from 128 transitions on, one batch
# of 32 per env step (the experiment's ratio: samples_per_insert = batch_size), small networks.
TINY = ("layout=single", "seed=1", "loop.progress=false", "loop.checkpoint_every=0",
        "loop.total_env_steps=384", "loop.replay.capacity=1000", "loop.replay.batch_size=32",
        "loop.replay.samples_per_insert=32", "loop.replay.tolerance=64",
        "loop.replay.min_size=128", "loop.hparams.hidden_sizes=[32,32]")


def test_halfcheetah_sac_runs_a_few_hundred_steps_and_learns_from_its_replay(
        tmp_path: Path) -> None:
    proc = run_app("+experiment=halfcheetah_sac", *TINY, f"hydra.run.dir={tmp_path}",
                   timeout=120)
    assert proc.returncode == 0, describe(proc)
    rank = read_result(tmp_path)["ranks"][0]["result"]
    assert rank["env_steps"] == 384
    rows = metrics(tmp_path)
    last = rows[-1]
    assert last["replay_inserts"] == last["replay_size"] == 384
    assert rows[0]["learner_wait"] == 1.0  # nothing learnt before min_size
    steps = sum(r["learner_steps"] for r in rows)
    # One learner step per env step past min_size, within the limiter's tolerance of a batch.
    assert abs(steps - (384 - 128)) <= 2, steps
    assert last["samples_per_insert"] == pytest.approx(32, abs=64 / (384 - 128))
