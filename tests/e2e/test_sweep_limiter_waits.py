"""A sweep ranks off-policy jobs by the seconds their collectors waited on the limiter
(``python -m app --multirun loop=dqn ... sweep.rank_by=collector_wait_s``, docs/off-policy.md
"Records"): the metric is a DQN loop's, fewer seconds rank first, and the order is the jobs'
own result.json values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.loops.dqn import DQNLoop
from app.metrics import direction
from tests.helpers.apprun import describe, run_app

pytestmark = pytest.mark.e2e

# A quarter sample per insert (the learner waits, the collectors never) and 64 (the collectors
# wait on the learner's steps): tests/e2e/test_rate_limiter.py's two sides, shorter.
RATIOS = ("0.25", "64")
SHAPE = ("loop.hparams.num_envs=4", "loop.hparams.num_steps=8", "loop.checkpoint_every=0",
         "loop.replay.min_size=256", "loop.replay.batch_size=32", "loop.replay.tolerance=64",
         "loop.total_env_steps=768", "loop.progress=false", "layout=single", "seed=1")


def test_a_sweep_ranks_dqn_jobs_by_collector_wait_s(tmp_path: Path) -> None:
    loop = f"{DQNLoop.__module__}.{DQNLoop.__qualname__}"
    assert direction("collector_wait_s", loop) == "min"  # seconds lost: fewer is better
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "loop=dqn", f"loop.replay.samples_per_insert={','.join(RATIOS)}",
                   "sweep.rank_by=collector_wait_s", *SHAPE, f"hydra.sweep.dir={sweep}",
                   timeout=240)
    assert proc.returncode == 0, describe(proc)
    summary = json.loads((sweep / "summary.json").read_text())
    assert (summary["rank_by"], summary["direction"]) == ("collector_wait_s", "min")
    jobs = summary["jobs"]
    assert [j["status"] for j in jobs] == ["ok", "ok"]
    waits = {}
    for job in jobs:  # each job's own result.json (every rank ended: run_app, none survived)
        result = json.loads((sweep / str(job["job"]) / "result.json").read_text())
        assert job["metrics"]["collector_wait_s"] == result["metrics"]["collector_wait_s"]
        label = next(o for o in job["overrides"] if o.startswith("loop.replay.samples_per"))
        waits[label] = result["metrics"]["collector_wait_s"]
    low, high = (f"loop.replay.samples_per_insert={r}" for r in RATIOS)
    assert waits[low] == 0.0 < waits[high], waits  # the slow learner's collectors waited
    ranked = sorted(waits, key=waits.__getitem__)  # ascending: the metric's direction
    assert [g["label"] for g in summary["ranking"]] == ranked == [low, high]
    assert [g["median"] for g in summary["ranking"]] == [waits[k] for k in ranked]
    table = [line for line in (sweep / "summary.md").read_text().splitlines()
             if line.startswith("| ")][1:]
    assert [row.strip("|").split(" | ")[1].strip() for row in table] == ranked
    assert (sweep / "summary.md").read_text().strip() in proc.stdout
