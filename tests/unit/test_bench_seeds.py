"""What ``python -m benchmarks --only seeds`` computes from its runs (docs/benchmarks.md, "Every
shipped configuration over ten seeds"): the interquartile mean, the percentile intervals of the
(stratified) bootstrap, the solved fraction and the aggregates over the solved seeds only, the
learning curves held on a common grid, the issue's goals, and the seeds a command line names."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import seeds, seeds_report
from benchmarks.aggregates import (
    bootstrap,
    iqm,
    iqm_rows,
    mean_rows,
    median,
    median_rows,
    stratified_bootstrap,
)
from benchmarks.seeds import SeedRun

pytestmark = pytest.mark.unit


def test_the_iqm_is_the_mean_of_the_middle_half_as_scipy_trims_it() -> None:
    assert iqm(range(1, 11)) == pytest.approx(5.5)  # 2 cut from each end: mean of 3..8
    assert iqm([0, 0, 0, 0, 100]) == 0.0  # one cut from each end of five: the outlier is out
    assert iqm([7, 1, 3]) == pytest.approx(11 / 3)  # nothing cut from three
    assert median([4, 1, 3, 2]) == pytest.approx(2.5)
    trim_mean = pytest.importorskip("scipy.stats").trim_mean
    rng = np.random.default_rng(5)
    for n in (4, 10, 17, 40):
        values = rng.lognormal(size=n)
        assert iqm(values) == pytest.approx(trim_mean(values, 0.25))
    with pytest.raises(ValueError, match="no values"):
        iqm([])


def test_the_bootstrap_gives_the_binomial_percentiles_of_a_solved_fraction() -> None:
    # Five of ten solved: the resampled fraction is Binomial(10, 0.5) / 10, whose 2.5% and
    # 97.5% quantiles are 0.2 and 0.8.
    interval = bootstrap([1.0] * 5 + [0.0] * 5, mean_rows)
    assert (interval.value, interval.low, interval.high) == (0.5, pytest.approx(0.2),
                                                            pytest.approx(0.8))
    same = bootstrap([3.0] * 10, iqm_rows)
    assert (same.value, same.low, same.high) == (3.0, 3.0, 3.0)  # no spread, no interval
    wide = bootstrap(list(range(10)), median_rows, confidence=0.99)
    narrow = bootstrap(list(range(10)), median_rows, confidence=0.5)
    assert wide.low < narrow.low <= 4.5 <= narrow.high < wide.high


def test_the_stratified_bootstrap_resamples_within_each_task() -> None:
    # Each replicate keeps each task's count of runs: one task all 0, the other all 1, so every
    # replicate's mean is 0.5. Pooled, the plain bootstrap's means spread around it.
    tasks = {"a": [0.0] * 10, "b": [1.0] * 10}
    stratified = stratified_bootstrap(tasks, mean_rows)
    assert (stratified.low, stratified.high) == (0.5, 0.5)
    pooled = bootstrap(tasks["a"] + tasks["b"], mean_rows)
    assert pooled.low < 0.4 and pooled.high > 0.6
    with pytest.raises(ValueError, match="at least one run"):
        stratified_bootstrap({"a": [1.0], "b": []}, mean_rows)


def _run(seed: int, steps: int | None, seconds: float | None = None) -> SeedRun:
    solved = steps is not None
    return SeedRun("cfg", seed, solved=solved, env_steps_to_target=steps,
                   time_to_target_s=seconds if solved else None, budget=400_000, target=475.0,
                   load_before=1.0 + seed, load_after=2.0,
                   curve=[(1000, 1.0, 20.0), (2000, 2.0, 480.0 if solved else 300.0)])


def test_a_configuration_is_summarised_over_its_solved_seeds_beside_its_solved_fraction() -> None:
    runs = [_run(s, 1000 * (s + 1), 0.5 * (s + 1)) for s in range(8)] + [_run(8, None),
                                                                        _run(9, None)]
    summary = seeds_report.summarise(runs)
    assert (summary["seeds"], summary["solved"], summary["budget"]) == (10, 8, 400_000)
    assert summary["solved_fraction"]["value"] == pytest.approx(0.8)
    steps = summary["env_steps_to_target"]
    assert steps["iqm"]["value"] == pytest.approx(4500.0)  # of 1000..8000: mean of 3000..6000
    assert steps["median"]["value"] == pytest.approx(4500.0)
    assert steps["iqm"]["low"] < 4500 < steps["iqm"]["high"]
    assert summary["time_to_target_s"]["iqm"]["value"] == pytest.approx(2.25)
    assert summary["load"] == [1.0, 10.0]
    nothing = seeds_report.summarise([_run(0, None)])
    assert nothing["solved"] == 0 and nothing["env_steps_to_target"] is None
    table = "\n".join(seeds_report.table_lines({"ppo": summary}, [seeds.BY_NAME["ppo"]]))
    assert "**8 of 10** (400,000)" in table and "4,500 [" in table


def test_curves_are_held_at_their_last_value_on_the_common_grid() -> None:
    curves = [[(100, 0.1, 10.0), (200, 0.2, 20.0)], [(100, 0.1, 5.0)], []]
    grid, values = seeds_report.spread(curves, end=300)
    assert grid[0] == 0 and grid[-1] == 300 and values.shape == (3, grid.size)
    at = {x: int(np.searchsorted(grid, x)) for x in (0, 150, 300)}
    assert np.isnan(values[0, at[0]]) and values[0, at[150]] == 10.0 and values[0, at[300]] == 20.0
    assert values[1, at[300]] == 5.0  # stopped at 100 env steps: held there
    assert np.isnan(values[2]).all()


def test_the_issues_goals_are_checked_on_the_1t3r_runs() -> None:
    found = {
        "ppo_1t3r": [_run(s, 100_000 + 1000 * s, 3.0) for s in range(10)],
        "ppo_async_1t3r": [_run(s, 120_000 + 1000 * s, 3.0) for s in range(9)] + [_run(9, None)],
        "vtrace_1t3r": [_run(s, 200_000, 5.0) for s in range(8)] + [_run(8, None), _run(9, None)],
    }
    rows = {row.name: row for row in seeds.rows_of(found)}
    assert rows["ppo_async_1t3r: solved fraction"].met == "yes"  # 9 of 10
    assert rows["vtrace_1t3r: solved fraction"].met == "no"  # 8 of 10
    assert rows["ppo_1t3r: solved fraction"].met == "-"  # no goal
    ratio = rows["ppo_async_1t3r / ppo_1t3r: median env steps to target"]
    assert ratio.ratio is not None and ratio.ratio.median == pytest.approx(124_000 / 104_500)
    assert ratio.met == "yes"


def test_seeds_are_read_as_ranges_and_lists() -> None:
    assert seeds.parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert seeds.parse_seeds("5") == [5]
    assert tuple(range(10)) == seeds.SEEDS
