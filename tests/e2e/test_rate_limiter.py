"""The replay's rate limiter as a user sees it (``python -m app loop=dqn layout=single``): with
a fast collector and a slow learner (many samples per insert), and the reverse (a fraction of a
sample per insert), the samples per insert held stay within the declared tolerance after every
update, and the seconds each side waited on the limiter are recorded on the side that waits:
metrics.csv, result.json (the replay and the metrics a sweep compares), the closing summary and
the progress line (docs/off-policy.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.apprun import describe, metrics, read_result, run_app

pytestmark = pytest.mark.e2e

MIN_SIZE, BATCH, TOLERANCE = 256, 32, 64.0
# 4 envs x 8 steps: 32 transitions per update.
SHAPE = ("loop.hparams.num_envs=4", "loop.hparams.num_steps=8", "loop.checkpoint_every=0",
         f"loop.replay.min_size={MIN_SIZE}", f"loop.replay.batch_size={BATCH}",
         f"loop.replay.tolerance={TOLERANCE}", "loop.total_env_steps=1536", "layout=single",
         "seed=1")


def _run(tmp_path: Path, samples_per_insert: float) -> tuple[list[dict[str, float]], str, str,
                                                              dict[str, float]]:
    proc = run_app("loop=dqn", *SHAPE, f"loop.replay.samples_per_insert={samples_per_insert}",
                   f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    rows = metrics(tmp_path)
    past = [r for r in rows if r["replay_inserts"] >= MIN_SIZE]
    assert len(past) >= 30
    for row in past:  # within the tolerance of the declared ratio after every update
        target = samples_per_insert * (row["replay_inserts"] - MIN_SIZE)
        assert abs(row["replay_samples"] - target) <= TOLERANCE, row
    last = rows[-1]
    held = last["samples_per_insert"]
    assert abs(held - samples_per_insert) <= TOLERANCE / (last["replay_inserts"] - MIN_SIZE)
    result = read_result(tmp_path)
    replay, compared = result["summary"]["replay"], result["ranks"][0]["result"]["metrics"]
    for name in ("collector_wait_s", "learner_wait_s"):  # result.json; what a sweep compares
        assert replay[name] == pytest.approx(last[name], abs=1e-4)
        assert compared[name] == pytest.approx(last[name], abs=1e-4)
    waits = [r["collector_wait_s"] + r["learner_wait_s"] for r in rows]
    assert waits == sorted(waits)  # the run's totals so far: they only grow
    return rows, proc.stdout, proc.stderr, last


def test_a_slow_learner_makes_the_collectors_wait_within_tolerance(tmp_path: Path) -> None:
    # 64 samples per insert: 64 learner steps of 32 per 32-transition update. The next segment
    # is admitted only after nearly all of them, so collectors wait on the learner.
    _, stdout, stderr, last = _run(tmp_path, 64.0)
    assert last["collector_wait_s"] > 0
    assert last["collector_wait_s"] > last["learner_wait_s"], last
    assert f"limiter: collectors waited {last['collector_wait_s']:.1f} s" in stdout, stdout
    progress = [line for line in stderr.splitlines() if line.startswith("[rank0] dqn:")]
    assert progress and " limiter waits " in progress[-1], progress[-1:]


def test_a_slow_collector_makes_the_learner_wait_within_tolerance(tmp_path: Path) -> None:
    # A quarter sample per insert: one learner step per 4 updates. The collectors are never
    # held back; the learner waits for their inserts.
    rows, stdout, _, last = _run(tmp_path, 0.25)
    assert last["collector_wait_s"] == 0.0
    assert last["learner_wait_s"] > 0
    assert sum(r["learner_wait"] for r in rows) > len(rows) / 2  # most updates took no step
    assert f"learner waited {last['learner_wait_s']:.1f} s" in stdout, stdout
