"""The limiter's waits with the replay on its own rank (``python -m app loop=dqn
layout=replay_server``, docs/off-policy.md "The rate limiter"): with a fast collector and a slow
learner (many samples per insert) the collectors wait on the learner's steps as they do beside
the trainer, and that wait is measured from the replay rank's counts: in metrics.csv (a total
that only grows), result.json (the replay and the metrics a sweep compares) and the closing
summary, while the samples per insert held stay within the declared tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.apprun import describe, metrics, read_result, run_app

pytestmark = pytest.mark.e2e

MIN_SIZE, BATCH, TOLERANCE, SAMPLES_PER_INSERT = 256, 32, 64.0, 64.0
# 2 rollout ranks x 4 envs x 8 steps: 64 transitions per update, all to replay rank 1.
SHAPE = ("loop.hparams.num_envs=4", "loop.hparams.num_steps=8", "loop.checkpoint_every=0",
         f"loop.replay.min_size={MIN_SIZE}", f"loop.replay.batch_size={BATCH}",
         f"loop.replay.tolerance={TOLERANCE}",
         f"loop.replay.samples_per_insert={SAMPLES_PER_INSERT}", "loop.total_env_steps=1536",
         "loop.progress=false", "seed=1")


def test_a_slow_learner_makes_the_collectors_wait_on_replay_ranks(tmp_path: Path) -> None:
    # 64 samples per insert: 128 learner steps of 32 per 64-transition update. The next
    # segments are admitted only after nearly all of them, so collectors wait on the learner.
    proc = run_app("loop=dqn", "layout=replay_server", *SHAPE, f"hydra.run.dir={tmp_path}",
                   timeout=240)
    assert proc.returncode == 0, describe(proc)
    result = read_result(tmp_path)  # every rank ended and reported (run_app: none survived)
    assert sorted(entry["role"] for entry in result["ranks"]) == [
        "replay", "rollout", "rollout", "trainer"]
    rows = metrics(tmp_path)
    past = [r for r in rows if r["replay_inserts"] >= MIN_SIZE]
    assert len(past) >= 15
    # The ratio the replay rank held, as its answers to the trainer counted it: within the
    # tolerance of the declared one after every update (and a batch, for the segments that
    # reach the replay rank while the learner steps).
    for row in past:
        target = SAMPLES_PER_INSERT * (row["replay_inserts"] - MIN_SIZE)
        assert abs(row["replay_samples"] - target) <= TOLERANCE + BATCH, row
    last = rows[-1]
    server = next(e["result"]["replay_server"] for e in result["ranks"] if e["role"] == "replay")
    assert last["replay_inserts"] == server["inserts"] >= 1536
    # collector_wait_s is the attempt's total so far: it only grows, and the last row's is
    # what result.json and the summary report.
    waits = [r["collector_wait_s"] for r in rows]
    assert waits == sorted(waits)
    assert last["collector_wait_s"] > 0
    assert last["collector_wait_s"] > last["learner_wait_s"], last
    replay = result["summary"]["replay"]
    trainer = next(e["result"] for e in result["ranks"] if e["role"] == "trainer")
    for name in ("collector_wait_s", "learner_wait_s"):  # result.json; what a sweep compares
        assert replay[name] == pytest.approx(last[name], abs=1e-4)
        assert trainer["metrics"][name] == pytest.approx(last[name], abs=1e-4)
    assert (f"limiter: collectors waited {last['collector_wait_s']:.1f} s, "
            f"learner waited {last['learner_wait_s']:.1f} s") in proc.stdout, proc.stdout
