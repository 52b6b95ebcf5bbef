"""``sweep.png``: the ranked metric per group of jobs, median bar with min..max and each job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.sweep.report import SweepReport


@dataclass(frozen=True)
class SweepPlot:
    """What :func:`plot_sweep` drew, best first (groups without any value are left out)."""

    metric: str
    labels: tuple[str, ...]
    medians: tuple[float, ...]
    lows: tuple[float, ...]
    highs: tuple[float, ...]
    points: tuple[tuple[float, ...], ...]  # every job's value, per group


def sweep_plot_data(report: SweepReport) -> SweepPlot:
    groups = [g for g in report.groups if g.values]
    return SweepPlot(
        metric=report.rank_by,
        labels=tuple(g.label for g in groups),
        medians=tuple(float(g.median) for g in groups if g.median is not None),
        lows=tuple(min(g.values) for g in groups),
        highs=tuple(max(g.values) for g in groups),
        points=tuple(tuple(g.values) for g in groups),
    )


def plot_sweep(report: SweepReport, png: Path) -> SweepPlot:
    """Draws the report's ranking into ``png`` (matplotlib, Agg); returns the plotted data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = sweep_plot_data(report)
    rows = list(range(len(data.labels)))[::-1]  # best at the top
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.45 * max(1, len(rows))))
    if rows:
        errors = [
            [m - lo for m, lo in zip(data.medians, data.lows)],
            [hi - m for m, hi in zip(data.medians, data.highs)],
        ]
        ax.barh(rows, data.medians, xerr=errors, color="#4c72b0", alpha=0.7, capsize=4)
        for row, values in zip(rows, data.points):
            ax.plot(values, [row] * len(values), "k.", markersize=5)
        ax.set_yticks(rows, data.labels, fontsize=8)
    else:
        ax.text(0.5, 0.5, f"no job reported {data.metric}", ha="center", transform=ax.transAxes)
    better = "lower" if report.direction == "min" else "higher"
    ax.set_xlabel(f"{data.metric} ({better} is better; bar: median, whiskers: min..max)")
    missing = [g.label for g in report.groups if not g.values]
    title = f"sweep ranked by {data.metric}"
    if missing or report.failed:
        title += f" ({len(missing)} group(s) without a value, {len(report.failed)} failed job(s))"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return data
