"""``python -m benchmarks.seeds`` as a user runs it, cut to two seeds of asynchronous PPO on
1t3r with a tiny budget and a low target: each seed's run solves, and the page, the JSON and the
learning-curve picture carry them; run again into the same folder it reads the runs back instead
of running them again (docs/benchmarks.md, "Every shipped configuration over ten seeds")."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers.apprun import REPO, app_env, assert_no_survivors

pytestmark = pytest.mark.e2e

COMMAND = ("-m", "benchmarks.seeds", "--configs", "ppo_async_1t3r", "--seeds", "0-1",
           "--override", "loop.total_env_steps=15360", "--override", "loop.target_return=30")


def _benchmark(out: Path) -> subprocess.CompletedProcess[str]:
    marker = uuid.uuid4().hex
    try:
        return subprocess.run([sys.executable, *COMMAND, "--out", str(out)], cwd=REPO,
                              env=app_env(marker), capture_output=True, text=True, timeout=600,
                              check=False)
    finally:
        assert_no_survivors(marker)  # every app run and every rank it started


def test_two_seeds_are_run_reported_drawn_and_read_back_when_run_again(tmp_path: Path) -> None:
    proc = _benchmark(tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    document = json.loads((tmp_path / "results.json").read_text())
    runs = document["runs"]["ppo_async_1t3r"]
    assert [r["seed"] for r in runs] == [0, 1]
    for run in runs:
        assert run["problem"] == "" and run["solved"], run
        assert 0 < run["env_steps_to_target"] <= 15_360 and run["budget"] == 15_360
        assert run["load_before"] is not None and run["wall_s"] > 0
    summary = document["summaries"]["ppo_async_1t3r"]
    assert (summary["seeds"], summary["solved"]) == (2, 2)
    steps = summary["env_steps_to_target"]["median"]
    assert steps["low"] <= steps["value"] <= steps["high"]
    page = (tmp_path / "results.md").read_text()
    assert "`python -m app layout=1t3r loop.max_staleness=1` | **2 of 2** (15,360)" in page
    assert "loop.total_env_steps=15360 loop.target_return=30" in page  # the overrides, said
    picture = tmp_path / f"{document['date']}-seeds-ppo_async_1t3r.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({picture.name})" in page

    results = sorted(tmp_path.glob("ppo_async_1t3r/seed*/result.json"))
    written = [p.stat().st_mtime_ns for p in results]
    again = _benchmark(tmp_path)  # resumed: both runs are there already
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert [p.stat().st_mtime_ns for p in results] == written
    assert sorted(tmp_path.glob("ppo_async_1t3r/seed*/result.json")) == results
    assert json.loads((tmp_path / "results.json").read_text())["runs"] == document["runs"]
