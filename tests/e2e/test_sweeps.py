"""Sweeps through ``python -m app --multirun`` that rank their jobs (summary.json / summary.md /
sweep.png), with the basic and the local submitit launcher, by the shipped loops' metrics and by
a plugged-in loop's own; and plan_only's layout picture. The report, its ranking and the layout
pictures in this process are tests/unit/test_sweeps.py."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from app.metrics import direction
from tests.helpers.apprun import REPO, assert_commcheck_passed, describe, read_result, run_app
from tests.helpers.sweeps import PNG, PPO, PPO_METRICS, SCORED_KNOWN, scored_loop

pytestmark = pytest.mark.e2e


# A PPO budget of 2-4 updates per job; a target the first updates can reach (window 5).
SHORT_PPO = (
    "loop.progress=false", "loop.hparams.num_envs=4", "loop.hparams.num_steps=32",
    "loop.total_env_steps=512", "loop.target_return=20", "loop.window=5",
    "loop.checkpoint_every=0", "comm.timeout=120",
)


def test_plan_only_writes_layout_png_and_txt(tmp_path: Path) -> None:
    proc = run_app("plan_only=true", "layout=2x2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    assert f"layout picture: {tmp_path / 'layout.png'}" in proc.stdout
    assert (tmp_path / "layout.png").read_bytes()[:8] == PNG
    assert (tmp_path / "layout.txt").read_text().strip() in proc.stdout
    assert not (tmp_path / "logs").exists()


def table_rows(markdown: str) -> list[list[str]]:
    rows = [line for line in markdown.splitlines() if line.startswith("| ")][1:]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def check_sweep(sweep: Path, stdout: str, layouts: list[str], seeds: list[int], metric: str,
                failed: int = 0) -> None:
    """summary.json / summary.md / sweep.png against the jobs' own result.json."""
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["rank_by"] == metric
    jobs = {j["job"]: j for j in summary["jobs"]}
    ok = [j for j in jobs.values() if j["status"] == "ok"]
    assert len(ok) == len(layouts) * len(seeds) and len(jobs) == len(ok) + failed
    values: dict[str, list[float]] = {}
    for entry in ok:
        result = json.loads((sweep / str(entry["job"]) / "result.json").read_text())
        assert entry["metrics"] == result["metrics"]
        assert set(result["metrics"]) >= PPO_METRICS
        layout = next(o.split("=")[1] for o in entry["overrides"] if o.startswith("layout="))
        if result["metrics"][metric] is not None:
            values.setdefault(f"layout={layout}", []).append(result["metrics"][metric])
        assert (sweep / str(entry["job"]) / "layout.png").read_bytes()[:8] == PNG
        assert f"world_size={result['world_size']}" in (sweep / str(entry["job"]) / "layout.txt").read_text()
        rollout_wait = result["metrics"]["rollout_wait_fraction"]
        assert (rollout_wait is None) == (layout == "single")
        assert 0 < result["metrics"]["startup_s"] < result["metrics"]["wall_s"]
    sign = 1 if direction(metric, PPO) == "min" else -1
    expected = sorted(values, key=lambda label: sign * statistics.median(values[label]))
    rows = table_rows((sweep / "summary.md").read_text())
    ranked = [r for r in rows if r[0] != "failed"]
    assert [r[1] for r in ranked][: len(expected)] == expected
    for row in ranked:  # seeds grouped: one row per layout, with each seed's job
        assert len(row[2].split()) == len(seeds)
    assert [r[0] for r in rows[len(ranked):]] == ["failed"] * failed  # failed jobs last
    assert summary["plot"]["labels"] == expected
    assert summary["plot"]["medians"] == [statistics.median(values[k]) for k in expected]
    assert summary["plot"]["lows"] == [min(values[k]) for k in expected]
    assert summary["plot"]["highs"] == [max(values[k]) for k in expected]
    assert [sorted(p) for p in summary["plot"]["points"]] == [sorted(values[k]) for k in expected]
    assert (sweep / "sweep.png").read_bytes()[:8] == PNG
    assert f"sweep summary: {sweep / 'summary.md'}" in stdout
    assert (sweep / "summary.md").read_text().strip() in stdout  # the multirun ends with it


@pytest.mark.timeout(900)  # 10 jobs, 22 rank processes: about 2 minutes on 2 idle cores
def test_sweep_over_four_layouts_and_two_seeds_ranks_its_jobs(tmp_path: Path) -> None:
    conf = tmp_path / "conf" / "layout"
    conf.mkdir(parents=True)  # a layout whose jobs pass validation, then fail: rank 1's env raises
    (conf / "broken.yaml").write_text("# @package _global_\nlayout: {world_size: 2, trainers: [0], "
                                      "rollouts: [1]}\nloop: {env: {kwargs: {fail_rank: 1}}}\n")
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "layout=broken,single,1t1r,2t2r,1t3r", "seed=0,1",
                   "sweep.rank_by=env_steps_per_s", *SHORT_PPO, f"hydra.sweep.dir={sweep}",
                   "loop.env._target_=tests.helpers.failing_env.make_failing_env",
                   f"hydra.searchpath=[file://{tmp_path / 'conf'}]", timeout=840)
    assert proc.returncode != 0, describe(proc)  # the broken jobs fail the multirun...
    check_sweep(sweep, proc.stdout, ["single", "1t1r", "2t2r", "1t3r"], [0, 1],
                "env_steps_per_s", failed=2)  # ...yet the report covers every job
    failed = [r for r in table_rows((sweep / "summary.md").read_text()) if r[0] == "failed"]
    assert [r[2] for r in failed] == ["#0", "#1"]
    # The cause is rank 1's own error at its first step, whether or not rank 0 noticed the loss
    # (MembersLostError, a consequence) before the launcher stopped it.
    assert all(r[3].startswith("rank 1 exit code 1: EnvError: ") for r in failed), failed
    assert all("simulated fault after 0 steps" in r[3] for r in failed), failed


def test_sweep_through_the_local_submitit_launcher_ranks_its_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # Two jobs: each is a submitit process around a run (seeds grouped in the ranking:
    # test_sweep_over_four_layouts_and_two_seeds_ranks_its_jobs).
    proc = run_app("--multirun", "hydra/launcher=rlcomm_local", "layout=single,1t1r", "seed=0",
                   "+sweep.rank_by=env_steps_per_s", *SHORT_PPO, f"hydra.sweep.dir={sweep}",
                   timeout=540)
    assert proc.returncode == 0, describe(proc)
    check_sweep(sweep, proc.stdout, ["single", "1t1r"], [0], "env_steps_per_s")


def test_unknown_rank_by_metric_fails_before_any_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "layout=single,1t1r", "sweep.rank_by=speed",
                   f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 2, describe(proc)
    assert re.fullmatch(r"error: sweep\.rank_by: unknown metric 'speed'; known: .*",
                        proc.stderr.strip().splitlines()[-1])
    assert not list(sweep.glob("*/result.json")) and not (sweep / "0").exists()


def test_the_shipped_layout_sweep_composes_into_twelve_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "+experiment=layouts", "plan_only=true",
                   f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, describe(proc)
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["rank_by"] == "time_to_target_s"
    assert [sorted(o for o in j["overrides"] if o.startswith(("layout=", "seed=")))
            for j in summary["jobs"]] == [
        [f"layout={layout}", f"seed={seed}"]
        for layout in ("single", "1t1r", "2t2r", "1t3r") for seed in (0, 1, 2)
    ]
    assert all((sweep / str(n) / "layout.png").exists() for n in range(12))


def test_a_two_node_layout_through_the_local_submitit_launcher_simulates_its_nodes(
    tmp_path: Path,
) -> None:
    # submitit's local executor starts every rank on this machine on purpose, like the app's
    # own launcher: a layout's nodes are simulated there, not checked against the hosts.
    # Two layouts: the local preset's multirun leaves one result per job, ranked after the sweep
    # (as tests/cluster/test_slurm.py's test_multirun_over_two_layouts_leaves_one_result_per_job
    # checks for the SLURM preset).
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "hydra/launcher=rlcomm_local", "hydra.launcher.timeout_min=5",
                   "layout=2x2,1t3r", "loop=commcheck", "loop.latency_iters=3",
                   "loop.bandwidth_bytes=65536", "loop.bandwidth_iters=1", "comm.timeout=60",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, describe(proc)
    result = json.loads((sweep / "0" / "result.json").read_text())
    intra = {tuple(r["groups"]["INTRA_NODE"]["ranks"]) for r in result["ranks"]}
    assert intra == {(0, 1), (2, 3)}
    for job in ("0", "1"):
        assert_commcheck_passed(read_result(sweep / job), 4)
        assert sorted(p.name for p in (sweep / job / "logs").glob("rank*.log")) == [
            f"rank{r}.log" for r in range(4)]
    summary = json.loads((sweep / "summary.json").read_text())
    assert [(j["job"], j["status"]) for j in summary["jobs"]] == [(0, "ok"), (1, "ok")]
    # Ranked after the sweep, in the submitting process (commcheck's default metric).
    assert summary["rank_by"] == "max_latency_us" and len(summary["ranking"]) == 2
    assert (sweep / "summary.md").read_text().strip() in proc.stdout


def test_a_sweep_ranks_by_a_metric_a_plugged_in_loop_declares(tmp_path: Path) -> None:
    target = scored_loop(tmp_path, "scored")
    env = {"PYTHONPATH": f"{REPO}:{tmp_path}"}
    args = ("--multirun", "layout=single", "loop=custom", f"loop._target_={target}")
    sweep = tmp_path / "sweep"
    proc = run_app(*args, "+loop.scale=1,3", "sweep.rank_by=score", f"hydra.sweep.dir={sweep}",
                   env=env, cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    summary = json.loads((sweep / "summary.json").read_text())
    assert (summary["rank_by"], summary["direction"]) == ("score", "max")
    assert [j["metrics"]["score"] for j in summary["jobs"]] == [1, 3]  # as each job reported it
    assert [(g["label"], g["median"]) for g in summary["ranking"]] == [
        ("+loop.scale=3", 3), ("+loop.scale=1", 1)
    ]  # higher first: the loop's direction
    assert [r[1] for r in table_rows((sweep / "summary.md").read_text())] == [
        "+loop.scale=3", "+loop.scale=1"
    ]
    assert "Ranked by `score` (higher is better)" in proc.stdout
    # A name this loop does not declare fails before any job, listing what it does.
    proc = run_app(*args, "+loop.scale=1,3", "sweep.rank_by=speed",
                   f"hydra.sweep.dir={tmp_path / 'bad'}", env=env, cwd=tmp_path)
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: sweep.rank_by: unknown metric 'speed'; {SCORED_KNOWN}"
    )
    assert not (tmp_path / "bad" / "0").exists()
