"""The ``seeds`` section's page: the table of every configuration over its seeds (solved
fraction, interquartile mean and median of the env steps and time to the target, 95% bootstrap
confidence intervals), each run's figures with the load, and one learning-curve picture per
configuration with every seed and the spread (benchmarks/seeds.py runs them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .aggregates import Interval, bootstrap, iqm_rows, mean_rows, median_rows

if TYPE_CHECKING:
    from .seeds import Config, SeedRun

# The curves' common grid: the median and the quartiles are read at these many env-step points.
GRID_POINTS = 200


def summarise(runs: Sequence[SeedRun]) -> dict[str, Any]:
    """One configuration's aggregates: the solved fraction (with its bootstrap interval), and
    over the solved seeds the IQM and median of env steps and training seconds to the target,
    each with its interval; the budget, the target and the range of the load."""
    solved = [r for r in runs if r.solved]
    out: dict[str, Any] = {
        "seeds": len(runs), "solved": len(solved),
        "solved_fraction": bootstrap([float(r.solved) for r in runs], mean_rows).as_dict(),
        "budget": next((r.budget for r in runs if r.budget), None),
        "target": next((r.target for r in runs if r.target is not None), None),
        "problems": {r.seed: r.problem for r in runs if r.problem},
    }
    loads = [x for r in runs for x in (r.load_before, r.load_after) if x is not None]
    out["load"] = [min(loads), max(loads)] if loads else None
    for key in ("env_steps_to_target", "time_to_target_s"):
        values = [float(getattr(r, key)) for r in solved]
        out[key] = ({name: bootstrap(values, fn).as_dict()
                     for name, fn in (("iqm", iqm_rows), ("median", median_rows))} if values else None)
    return out


def _interval(found: dict[str, float] | None, digits: int) -> str:
    if found is None:
        return "-"
    interval = Interval(found["value"], found["low"], found["high"])
    fmt = f"{{:,.{digits}f}}"
    return (f"{fmt.format(interval.value)} [{fmt.format(interval.low)}, "
            f"{fmt.format(interval.high)}]")


def table_lines(summaries: dict[str, dict[str, Any]], configs: Sequence[Config]) -> list[str]:
    """The Markdown table, one row per configuration."""
    lines = [
        "| configuration | command | solved (budget) | env steps to target: IQM [95% CI] | "
        "median [95% CI] | training s to target: IQM [95% CI] | median [95% CI] | "
        "load (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config in configs:
        s = summaries.get(config.name)
        if s is None:
            continue
        steps, secs = s["env_steps_to_target"] or {}, s["time_to_target_s"] or {}
        budget = f"{s['budget']:,}" if s["budget"] else "?"
        load = f"{s['load'][0]:.1f}-{s['load'][1]:.1f}" if s["load"] else "-"
        name = config.words + (" (variant)" if config.variant else "")
        lines.append(
            f"| {name} | `{config.command}` | **{s['solved']} of {s['seeds']}** ({budget}) | "
            f"{_interval(steps.get('iqm'), 0)} | {_interval(steps.get('median'), 0)} | "
            f"{_interval(secs.get('iqm'), 2)} | {_interval(secs.get('median'), 2)} | {load} |")
    return lines


def per_seed_lines(found: dict[str, list[SeedRun]]) -> list[str]:
    """Every run: solved or not, env steps and seconds to the target, final mean return, wall
    time from launch to exit and the load before and after it."""
    lines = ["| configuration | seed | solved | env steps to target | training s to target | "
             "final mean return | launch to exit (s) | load before / after |",
             "|---|---|---|---|---|---|---|---|"]
    for name, runs in found.items():
        for r in runs:
            steps = f"{r.env_steps_to_target:,}" if r.env_steps_to_target else "-"
            loads = " / ".join("-" if x is None else f"{x:.1f}"
                               for x in (r.load_before, r.load_after))
            solved = "yes" if r.solved else ("no: " + r.problem if r.problem else "no")
            lines.append(f"| {name} | {r.seed} | {solved} | {steps} | "
                         f"{r.time_to_target_s if r.time_to_target_s is not None else '-'} | "
                         f"{r.final_mean_return if r.final_mean_return is not None else '-'} | "
                         f"{r.wall_s if r.wall_s is not None else '-'} | {loads} |")
    return lines


def spread(curves: Sequence[Sequence[tuple[int, float, float]]], end: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """The env-step grid up to ``end`` and every curve's return on it ([curves, grid]): each
    curve holds its last value after it stopped (at its target, or at its budget), and is NaN
    before its first point."""
    grid = np.linspace(0, end, GRID_POINTS)
    values = np.full((len(curves), grid.size), np.nan)
    for i, curve in enumerate(curves):
        if not curve:
            continue
        steps = np.array([p[0] for p in curve], dtype=float)
        returns = np.array([p[2] for p in curve])
        index = np.searchsorted(steps, grid, side="right") - 1
        values[i] = np.where(index >= 0, returns[np.clip(index, 0, None)], np.nan)
    return grid, values


def plot(config: Config, runs: Sequence[SeedRun], summary: dict[str, Any], path: Path) -> None:
    """Every seed's mean return of the last episodes (the stop rule's) against env steps, the
    median over seeds and the band between the quartiles, the target and the budget."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots(gridspec_kw={"left": 0.1, "right": 0.97, "bottom": 0.12, "top": 0.86})
    curves = [r.curve for r in runs]
    # To the last run's end: the budget when a seed did not solve, else where the last solved.
    end = max([c[-1][0] for c in curves if c], default=summary["budget"] or 1)
    for r in runs:
        if r.curve:
            ax.plot([p[0] for p in r.curve], [p[2] for p in r.curve], linewidth=0.8, alpha=0.5,
                    color="tab:green" if r.solved else "tab:red")
    grid, values = spread(curves, end)
    have = ~np.all(np.isnan(values), axis=0)
    if have.any():
        q1, mid, q3 = np.nanpercentile(values[:, have], [25, 50, 75], axis=0)
        ax.fill_between(grid[have], q1, q3, color="tab:blue", alpha=0.2,
                        label="quartiles over seeds")
        ax.plot(grid[have], mid, color="tab:blue", linewidth=2, label="median over seeds")
    if summary["target"] is not None:
        ax.axhline(summary["target"], linestyle="--", color="grey", label="target")
    if summary["budget"] and summary["budget"] <= end:
        ax.axvline(summary["budget"], linestyle=":", color="black", label="budget")
    ax.set_xlabel("env steps")
    ax.set_ylabel("mean return of the last 20 episodes")
    ax.legend(loc="lower right", fontsize="small")
    budget = f" within {summary['budget']:,} env steps" if summary["budget"] else ""
    fig.suptitle(f"{config.command}: {summary['solved']} of {summary['seeds']} seeds solved"
                 f"{budget}\n(green: solved, red: not; a run that stopped is held at its last "
                 "value)", fontsize="medium")
    fig.savefig(path)


def write_report(found: dict[str, list[SeedRun]], configs: Sequence[Config], out: Path,
                 meta: dict[str, Any]) -> Path:
    """``out/results.md`` (a dated section for benchmarks/results/), ``out/results.json`` and
    ``out/<date>-seeds-<config>.png``; returns the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    shown = [c for c in configs if found.get(c.name)]
    summaries = {c.name: summarise(found[c.name]) for c in shown}
    pictures = []
    for config in shown:
        picture = f"{meta['date']}-seeds-{config.name}.png"
        plot(config, found[config.name], summaries[config.name], out / picture)
        pictures.append(f"![{config.command}]({picture})")
    env = meta["environment"]
    lines = [
        f"## Every shipped configuration over its seeds, {meta['date']}", "",
        f"`python -m benchmarks --only seeds` (or `python -m benchmarks.seeds`): each command on "
        f"its defaults, once per seed, one run at a time; {env['cpus']} CPU cores, torch "
        f"{env['torch']}, Python {env['python']}."
        + (f" Every run had `{' '.join(meta['overrides'])}` added." if meta["overrides"] else ""),
        "Solved: the mean return of the last 20 episodes reached the target within the budget "
        "(env steps). The IQM (mean of the middle half) and the median are over the solved seeds, "
        "with 95% percentile intervals of a bootstrap over them (10,000 resamples); training "
        "seconds count from the training loop's start (`summary.time_to_target_s`).", "",
        *table_lines(summaries, shown), "", *pictures, "", "Every run:", "",
        *per_seed_lines({c.name: found[c.name] for c in shown}), "",
    ]
    page = out / "results.md"
    page.write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps(
        {**meta, "summaries": summaries,
         "runs": {name: [r.as_dict() for r in runs] for name, runs in found.items()}}, indent=1))
    return page
