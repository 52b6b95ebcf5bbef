"""Sweeps that rank their jobs (summary.json / summary.md / sweep.png) and layout pictures."""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from app.errors import ConfigError
from app.launch.planning import validate
from app.loops.commcheck import group_metrics, slowest_group
from app.output.layout_picture import describe_layout, draw_layout, write_layout_files
from app.sweep.metrics import (
    check_metric_name,
    default_rank_by,
    direction,
    headline,
    known_metrics,
)
from app.sweep.plot import sweep_plot_data
from app.sweep.report import JobRecord, build_report, format_table, group_by_seed, rank_groups
from rlcomm import LayoutPlan, LayoutSpec, plan_layout
from tests.helpers.apprun import REPO, assert_commcheck_passed, describe, read_result, run_app

PNG = b"\x89PNG\r\n\x1a\n"
PPO = "app.loops.ppo.PPOLoop"
COMMCHECK = "app.loops.commcheck.CommCheck"
# A PPO budget of 2-4 updates per job; a target the first updates can reach (window 5).
SHORT_PPO = (
    "loop.progress=false", "loop.hparams.num_envs=4", "loop.hparams.num_steps=32",
    "loop.total_env_steps=512", "loop.target_return=20", "loop.window=5",
    "loop.checkpoint_every=0", "comm.timeout=120",
)
PPO_METRICS = {
    "env_steps_per_s", "time_to_target_s", "env_steps_to_target", "reached_target",
    "updates_per_s", "transfer_s", "transfer_share", "trainer_wait_fraction",
    "rollout_wait_fraction", "final_mean_return", "startup_s", "group_creation_s", "wall_s",
}


# ---- pure functions: ranking and grouping ---------------------------------------------------


def job(num: int, layout: str, seed: int, value: float | None, status: str = "ok",
        metric: str = "time_to_target_s") -> JobRecord:
    return JobRecord(num, (f"layout={layout}", f"seed={seed}", "loop.target_return=475"), status,
                     {metric: value, "env_steps_per_s": 100.0 * (num + 1)}, loop=PPO,
                     error="boom" if status == "failed" else None)


@pytest.mark.unit
def test_jobs_that_differ_only_in_seed_form_one_group_labelled_by_what_varies() -> None:
    jobs = [job(0, "single", 0, 5.0), job(1, "single", 1, 7.0), job(2, "2t2r", 0, 3.0)]
    groups = group_by_seed(jobs, "time_to_target_s")
    assert [(g.label, [j.job for j in g.jobs]) for g in groups] == [
        ("layout=single", [0, 1]), ("layout=2t2r", [2])
    ]  # loop.target_return=475 is common to all jobs: not in the labels
    assert (groups[0].median, min(groups[0].values), max(groups[0].values)) == (6.0, 5.0, 7.0)
    assert [j.seed for j in groups[0].jobs] == ["0", "1"]


@pytest.mark.unit
def test_ranking_follows_the_metrics_direction_and_puts_missing_values_last() -> None:
    jobs = [
        job(0, "a", 0, 5.0), job(1, "a", 1, 9.0),  # median 7
        job(2, "b", 0, 4.0), job(3, "b", 1, None),  # one seed did not reach the target
        job(4, "c", 0, 6.0), job(5, "c", 1, 6.5),  # median 6.25
        job(6, "d", 0, None), job(7, "d", 1, None),  # no value at all
    ]
    lowest = rank_groups(group_by_seed(jobs, "time_to_target_s"), "min")
    assert [g.label for g in lowest] == ["layout=c", "layout=a", "layout=b", "layout=d"]
    highest = rank_groups(group_by_seed(jobs, "time_to_target_s"), "max")
    assert [g.label for g in highest] == ["layout=a", "layout=c", "layout=b", "layout=d"]


@pytest.mark.unit
def test_report_uses_the_loops_default_metric_and_lists_failed_jobs_last() -> None:
    jobs = [job(0, "x", 0, None, status="failed"), job(1, "a", 0, 8.0), job(2, "b", 0, 2.0)]
    report = build_report(jobs)
    assert report.rank_by == "time_to_target_s" and report.direction == "min"
    table = format_table(report)
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[:3] for r in rows] == [
        ["| 1", "layout=b", "#2"], ["| 2", "layout=a", "#1"], ["| failed", "layout=x seed=0 loop.target_return=475", "#0"],
    ]
    assert "boom" in rows[-1]
    assert "lower is better" in table
    by_speed = build_report(jobs, rank_by="env_steps_per_s")
    assert [g.label for g in by_speed.groups] == ["layout=b", "layout=a"]  # 300/s before 200/s
    plot = sweep_plot_data(by_speed)
    assert plot.labels == ("layout=b", "layout=a") and plot.medians == (300.0, 200.0)


@pytest.mark.unit
def test_metric_registry_knows_every_direction_and_rejects_unknown_names() -> None:
    assert direction("time_to_target_s", PPO) == "min" and direction("env_steps_per_s", PPO) == "max"
    assert direction("latency_us:WEIGHT_TRANSFER[0,2]", COMMCHECK) == "min"
    assert set(known_metrics(PPO, COMMCHECK).values()) == {"min", "max"}
    assert default_rank_by(PPO) == "time_to_target_s"
    assert default_rank_by(COMMCHECK) == "max_latency_us"
    assert default_rank_by("mypkg.loops.CountRanks") == "wall_s"
    with pytest.raises(ConfigError, match=r"^sweep.rank_by: unknown metric 'speed'; known: "):
        check_metric_name("speed", PPO)


@pytest.mark.unit
def test_commcheck_metrics_take_each_groups_slowest_member() -> None:
    def figures(ranks: list[int], latency: float, gbps: float) -> dict:
        return {"ranks": ranks, "allreduce_latency_us": latency, "broadcast_gbps": gbps}

    reports = [
        {"GLOBAL": figures([0, 1], 50.0, 2.0), "WEIGHT_TRANSFER": figures([0, 1], 80.0, 1.0)},
        {"GLOBAL": figures([0, 1], 60.0, 1.5), "WEIGHT_TRANSFER": figures([0, 1], 70.0, 1.2)},
    ]
    metrics = group_metrics(reports)
    assert metrics["latency_us:GLOBAL[0,1]"] == 60.0 and metrics["bandwidth_gbps:GLOBAL[0,1]"] == 1.5
    assert metrics["max_latency_us"] == 80.0 and metrics["min_bandwidth_gbps"] == 1.0
    assert slowest_group(metrics) == "WEIGHT_TRANSFER[0,1]"


# ---- layout pictures ------------------------------------------------------------------------


def shipped_plan(layout: str) -> LayoutPlan:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return validate(compose("config", overrides=[f"layout={layout}", "loop=commcheck"]))


def spans(picture: object, mode: str) -> list[tuple[int, ...]]:
    band = next(b for b in picture.bands if b.mode == mode)  # type: ignore[attr-defined]
    return [s.ranks for s in band.spans]


@pytest.mark.unit
def test_layout_pictures_of_the_shipped_layouts(tmp_path: Path) -> None:
    single = describe_layout(shipped_plan("single"))
    assert [(c.rank, c.role) for c in single.cells] == [(0, "trainer+rollout")]
    assert len(single.boxes) == 1 and single.hidden_ranks == 0

    default = describe_layout(shipped_plan("2t2r"))
    assert [(c.rank, c.role) for c in default.cells] == [
        (0, "trainer"), (1, "trainer"), (2, "rollout"), (3, "rollout")
    ]
    assert spans(default, "WEIGHT_TRANSFER") == [(0, 2), (1, 3)]
    assert spans(default, "TRAIN_DATA_PARALLEL") == [(0, 1)]

    nodes = describe_layout(shipped_plan("2x2"))
    assert [[c.rank for c in box.cells] for box in nodes.boxes] == [[0, 1], [2, 3]]
    assert spans(nodes, "INTRA_NODE") == [(0, 1), (2, 3)]
    assert spans(nodes, "INTER_NODE") == [(0, 2), (1, 3)]
    assert spans(nodes, "WEIGHT_TRANSFER") == [(0, 1), (2, 3)]
    assert nodes.column(1) < nodes.column(2)  # node 1's ranks sit right of node 0's

    grid = describe_layout(shipped_plan("tp2dp2"))
    assert spans(grid, "TENSOR_PARALLEL") == [(0, 1), (2, 3)]
    assert spans(grid, "DATA_PARALLEL") == [(0, 2), (1, 3)]
    assert all(c.role == "trainer+rollout" for c in grid.cells)

    png = write_layout_files(shipped_plan("2x2"), tmp_path)
    assert png.read_bytes()[:8] == PNG
    assert "WEIGHT_TRANSFER" in (tmp_path / "layout.txt").read_text()


@pytest.mark.unit
def test_a_65536_rank_layout_is_drawn_summarised_in_under_two_seconds(tmp_path: Path) -> None:
    world = 65_536
    plan = plan_layout(LayoutSpec(
        world, ranks_per_node=8, trainers=list(range(0, world, 8)),
        rollouts=[r for r in range(world) if r % 8], tensor_parallel_size=2,
    ))
    draw_layout(describe_layout(plan_layout(LayoutSpec(2, trainers=[0, 1]))), tmp_path / "w.png")
    # matplotlib is imported above: this times the drawing itself, in CPU time, since on a
    # shared 2-core machine the wall clock measures the neighbours (0.6 s CPU here).
    start = time.process_time()
    picture = describe_layout(plan)
    draw_layout(picture, tmp_path / "layout.png")
    elapsed = time.process_time() - start
    assert elapsed < 2.0, elapsed
    assert [box.node for box in picture.boxes] == [0, 1, 2, 8191]  # first nodes and the last
    assert picture.hidden_nodes == 8188 and len(picture.cells) == 32
    assert picture.hidden_ranks == world - 32
    assert [c.role for c in picture.boxes[-1].cells] == ["trainer"] + ["rollout"] * 7
    assert spans(picture, "WEIGHT_TRANSFER")[-1] == tuple(range(world - 8, world))
    wt = next(b for b in picture.bands if b.mode == "WEIGHT_TRANSFER")
    assert wt.groups == 8192 and len(wt.spans) == 4
    assert (tmp_path / "layout.png").read_bytes()[:8] == PNG


@pytest.mark.e2e
def test_plan_only_writes_layout_png_and_txt(tmp_path: Path) -> None:
    proc = run_app("plan_only=true", "layout=2x2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    assert f"layout picture: {tmp_path / 'layout.png'}" in proc.stdout
    assert (tmp_path / "layout.png").read_bytes()[:8] == PNG
    assert (tmp_path / "layout.txt").read_text().strip() in proc.stdout
    assert not (tmp_path / "logs").exists()


# ---- real sweeps ----------------------------------------------------------------------------


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


@pytest.mark.e2e
@pytest.mark.timeout(900)  # 10 jobs, 22 rank processes: about 2 minutes on 2 idle cores
def test_sweep_over_four_layouts_and_two_seeds_ranks_its_jobs(tmp_path: Path) -> None:
    conf = tmp_path / "conf" / "layout"
    conf.mkdir(parents=True)  # a layout that fails in its job: rank 2 has no role
    (conf / "broken.yaml").write_text("defaults: [layout_schema, _self_]\nworld_size: 3\n"
                                      "trainers: [0]\nrollouts: [1]\n")
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "layout=broken,single,1t1r,2t2r,1t3r", "seed=0,1",
                   "sweep.rank_by=env_steps_per_s", *SHORT_PPO, f"hydra.sweep.dir={sweep}",
                   f"hydra.searchpath=[file://{tmp_path / 'conf'}]", timeout=840)
    assert proc.returncode != 0, describe(proc)  # the broken jobs fail the multirun...
    check_sweep(sweep, proc.stdout, ["single", "1t1r", "2t2r", "1t3r"], [0, 1],
                "env_steps_per_s", failed=2)  # ...yet the report covers every job
    failed = [r for r in table_rows((sweep / "summary.md").read_text()) if r[0] == "failed"]
    assert [r[2] for r in failed] == ["#0", "#1"]
    assert all("ranks [2] are neither trainers nor rollouts" in r[3] for r in failed)


@pytest.mark.e2e
def test_sweep_through_the_local_submitit_launcher_ranks_its_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "hydra/launcher=rlcomm_local", "layout=single,1t1r", "seed=0,1",
                   "+sweep.rank_by=env_steps_per_s", *SHORT_PPO, f"hydra.sweep.dir={sweep}",
                   timeout=540)
    assert proc.returncode == 0, describe(proc)
    check_sweep(sweep, proc.stdout, ["single", "1t1r"], [0, 1], "env_steps_per_s")


@pytest.mark.e2e
def test_unknown_rank_by_metric_fails_before_any_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "layout=single,1t1r", "sweep.rank_by=speed",
                   f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 2, describe(proc)
    assert re.fullmatch(r"error: sweep\.rank_by: unknown metric 'speed'; known: .*",
                        proc.stderr.strip().splitlines()[-1])
    assert not list(sweep.glob("*/result.json")) and not (sweep / "0").exists()


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_two_node_layout_through_the_local_submitit_launcher_simulates_its_nodes(
    tmp_path: Path,
) -> None:
    # submitit's local executor starts every rank on this machine on purpose, like the app's
    # own launcher: a layout's nodes are simulated there, not checked against the hosts.
    # Two layouts: the local preset's multirun leaves one result per job, ranked after the sweep
    # (as test_slurm.py's test_multirun_over_two_layouts_leaves_one_result_per_job checks for
    # the SLURM preset).
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


# ---- a plugged-in loop's own metrics --------------------------------------------------------

SCORED_LOOP = '''
from dataclasses import dataclass
from typing import ClassVar

from app.api import LoopMetrics, setting


@dataclass
class Scored:
    """A loop with a figure of its own that no shipped loop reports: higher ``score`` is better."""

    scale: float = setting(1.0, "the score this job reports")

    metrics: ClassVar[LoopMetrics] = LoopMetrics({"score": "max"}, headline=("score",))

    def __call__(self, ctx, job):
        return {"metrics": {"score": self.scale}}
'''
SCORED_KNOWN = "known: group_creation_s, score, startup_s, wall_s"  # its own and the app's


def scored_loop(tmp_path: Path, package: str) -> str:
    """The loop above as ``<package>.loops`` under ``tmp_path``; returns its ``_target_``."""
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "loops.py").write_text(SCORED_LOOP)
    return f"{package}.loops.Scored"


@pytest.mark.unit
def test_the_shipped_loops_declare_the_metrics_they_report() -> None:
    assert set(known_metrics(PPO)) == PPO_METRICS  # what every PPO job's result.json holds
    for target in (PPO, COMMCHECK):
        assert set(headline(target)) <= set(known_metrics(target))
    check_metric_name("latency_us:GLOBAL[0,1]", COMMCHECK)  # per group: the base name's
    with pytest.raises(ConfigError, match=r"unknown metric 'latency_us:GLOBAL\[0,1\]'"):
        check_metric_name("latency_us:GLOBAL[0,1]", PPO)


@pytest.mark.unit
def test_a_plugged_in_loops_metrics_rank_its_report_and_check_rank_by(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = scored_loop(tmp_path, "scored_unit")
    monkeypatch.syspath_prepend(str(tmp_path))
    jobs = [JobRecord(n, (f"+loop.scale={v:g}",), "ok", {"score": v, "wall_s": 5.0 - v}, loop=target)
            for n, v in enumerate([1.0, 3.0, 2.0])]
    report = build_report(jobs)  # no sweep.rank_by: the loop's first headline metric
    assert (report.rank_by, report.direction, report.columns) == ("score", "max", ())
    assert [g.label for g in report.groups] == ["+loop.scale=3", "+loop.scale=2", "+loop.scale=1"]
    assert "higher is better" in format_table(report)
    by_wall = build_report(jobs, rank_by="wall_s")  # the app's figures rank any loop's jobs
    assert by_wall.direction == "min" and by_wall.groups[0].label == "+loop.scale=3"

    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    def validated(rank_by: str) -> None:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            validate(compose("config", overrides=[
                "layout=single", "loop=custom", f"loop._target_={target}", f"sweep.rank_by={rank_by}",
            ]))

    validated("score")
    with pytest.raises(ConfigError) as failure:  # PPO's figure, not this loop's
        validated("time_to_target_s")
    assert str(failure.value) == f"sweep.rank_by: unknown metric 'time_to_target_s'; {SCORED_KNOWN}"


@pytest.mark.e2e
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
