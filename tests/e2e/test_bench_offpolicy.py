"""``python -m benchmarks.offpolicy --quick`` as a user runs it, cut to DQN on the layout with two
collector ranks writing to one learner's replay (1t2r): the run finishes, and the table and
``results.json`` carry the learning phase's rates, the ratio held and each role's time split
(docs/benchmarks.md, "Off-policy throughput and CleanRL's SAC")."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers.apprun import REPO, app_env, assert_no_survivors

pytestmark = pytest.mark.e2e


def test_the_quick_smoke_of_dqn_on_two_collectors_prints_rates_and_the_split(
        tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.offpolicy", "--quick", "--only", "dqn",
             "--layouts", "1t2r", "--out", str(tmp_path)], cwd=REPO, env=app_env(marker),
            capture_output=True, text=True, timeout=240, check=False)
    finally:
        assert_no_survivors(marker)  # the benchmark's app run and every rank it started
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| dqn | 1t2r | 2 |" in proc.stdout and "| rollout |" in proc.stdout
    run = json.loads((tmp_path / "results.json").read_text())["runs"][0]
    assert run["problem"] == ""
    assert run["learning_env_steps_per_s"] > 0 and run["learner_steps_per_s"] > 0
    assert run["samples_per_insert"] == pytest.approx(8.0, abs=1.0)  # loop=dqn's ratio
    assert set(run["split"]) == {"trainer", "rollout"}
    for shares in run["split"].values():
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
    assert run["split"]["trainer"]["learn"] > 0 and run["split"]["rollout"]["collect"] > 0
    assert (tmp_path / "results.md").read_text().startswith("| algorithm |")
