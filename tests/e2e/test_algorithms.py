"""Algorithms plugged into the runtime, run through ``python -m app`` as a user runs them: the
example plugin (examples/reinforce.py) on a layout with rollout ranks and a colocated one, a sweep ranked by a
metric it declares, and V-trace with rollouts that lag the trainers (docs/custom-algorithm.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers.apprun import describe, metrics, read_result, run_app

pytestmark = pytest.mark.e2e

PLUGIN = ("loop=custom", "loop._target_=examples.reinforce.ReinforceLoop")
QUIET = ("+loop.progress=false", "+loop.checkpoint_every=0")


def _window(rows: list[dict[str, float]], first: bool, n: int = 3) -> float:
    """The mean of the per-update mean returns of the first (or last) ``n`` updates that had
    finished episodes."""
    returns = [r["mean_return"] for r in rows if not math.isnan(r["mean_return"])]
    part = returns[:n] if first else returns[-n:]
    return sum(part) / len(part)


@pytest.mark.parametrize("layout", ["2t2r", "single"])
def test_the_example_plugin_learns_on_any_layout_with_nothing_else_to_write(
    layout: str, tmp_path: Path
) -> None:
    proc = run_app(*PLUGIN, *QUIET, f"layout={layout}", "+loop.total_env_steps=49152",
                   "+loop.target_return=1e9", "seed=1", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    result = read_result(tmp_path)
    assert result["loop"] == "examples.reinforce.ReinforceLoop"
    assert {r["role"] for r in result["ranks"]} == (
        {"trainer", "rollout"} if layout == "2t2r" else {"trainer+rollout"})
    rows = metrics(tmp_path)
    # The runtime recorded the plugin's declared losses beside its own columns.
    assert all(math.isfinite(r[name]) for r in rows for name in ("pg_loss", "v_loss", "entropy"))
    first, last = _window(rows, first=True), _window(rows, first=False)
    assert first < 40 and last > 2 * first, (first, last)  # CartPole: random ~22


def test_a_sweep_ranks_jobs_by_a_metric_the_plugin_declares(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", *PLUGIN, *QUIET, "layout=single", "+loop.total_env_steps=4096",
                   "+loop.hparams.lr=1e-3,1e-2", "sweep.rank_by=v_loss",
                   f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, describe(proc)
    summary = json.loads((sweep / "summary.json").read_text())
    assert (summary["rank_by"], summary["direction"]) == ("v_loss", "min")
    losses = [job["metrics"]["v_loss"] for job in summary["jobs"]]
    assert all(isinstance(v, float) and v > 0 for v in losses), losses
    medians = [group["median"] for group in summary["ranking"]]
    assert medians == sorted(medians)  # lower first: the plugin's direction
    # The same name on a loop that does not declare it fails before any job starts.
    proc = run_app("--multirun", "layout=single", "sweep.rank_by=v_loss", "seed=0,1",
                   f"hydra.sweep.dir={tmp_path / 'bad'}")
    assert proc.returncode == 2 and "sweep.rank_by: unknown metric 'v_loss'" in proc.stderr


def test_vtrace_learns_with_rollouts_one_version_behind(tmp_path: Path) -> None:
    proc = run_app("loop=vtrace", "layout=2t2r", "loop.max_staleness=1", "seed=1",
                   "loop.total_env_steps=81920", "loop.target_return=1e9",
                   "loop.progress=false", "loop.checkpoint_every=0", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    result = read_result(tmp_path)
    trainers = [r["result"] for r in result["ranks"] if r["role"] == "trainer"]
    # The data lagged the weights (V-trace's case), never by more than the bound.
    assert all(set(t["staleness_histogram"]) <= {"0", "1"} for t in trainers)
    assert sum(t["staleness_histogram"].get("1", 0) for t in trainers) > 0
    rows = metrics(tmp_path)
    assert all(0 < r["rho_mean"] < 2 for r in rows)  # importance weights of a lagging policy
    first, last = _window(rows, first=True), _window(rows, first=False)
    assert first < 40 and last > 3 * first, (first, last)
