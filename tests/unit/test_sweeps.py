"""Sweeps that rank their jobs (summary.json / summary.md / sweep.png) and layout pictures, in
this process: grouping, ranking, the report, the metrics each loop declares, and the pictures.
Real sweeps through ``python -m app --multirun`` are tests/e2e/test_sweeps.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from app.errors import ConfigError
from app.launch.planning import validate
from app.loops.commcheck import group_metrics, slowest_group
from app.metrics import (
    check_metric_name,
    default_rank_by,
    direction,
    headline,
    known_metrics,
)
from app.output.layout_picture import describe_layout, draw_layout, write_layout_files
from app.sweep.plot import sweep_plot_data
from app.sweep.report import JobRecord, build_report, format_table, group_by_seed, rank_groups
from rlcomm import LayoutPlan, LayoutSpec, plan_layout
from tests.helpers.apprun import REPO
from tests.helpers.sweeps import PNG, PPO, PPO_METRICS, SCORED_KNOWN, scored_loop

COMMCHECK = "app.loops.commcheck.CommCheck"


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


# ---- a plugged-in loop's own metrics --------------------------------------------------------


@pytest.mark.unit
def test_the_shipped_loops_declare_the_metrics_they_report() -> None:
    assert set(known_metrics(PPO)) == PPO_METRICS  # what every PPO job's result.json holds
    for target in (PPO, COMMCHECK):
        assert set(headline(target)) <= set(known_metrics(target))
    check_metric_name("latency_us:GLOBAL[0,1]", COMMCHECK)  # per group: the base name's
    for name in ("eval_return_mean", "best_eval_return"):  # sweep.rank_by takes evaluations
        check_metric_name(name, PPO)
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


