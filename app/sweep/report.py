"""A sweep's jobs ranked by one metric: jobs that differ only in ``seed`` form one group
(median, min, max), failed jobs come last with their error.

Pure functions over plain records (no Hydra), so the ranking is tested on its own;
app/sweep/summary.py feeds them the sweep's ``summary.json`` and writes ``summary.md``.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.api import Direction
from app.metrics import check_metric_name, default_rank_by, direction, headline

Metrics = dict[str, float | None]
SEED_KEY = "seed"


@dataclass(frozen=True)
class JobRecord:
    """One sweep job as summary.json lists it, with the metrics of its result.json."""

    job: int
    overrides: tuple[str, ...]
    status: str  # "ok" | "failed"
    metrics: Metrics = field(default_factory=dict)
    error: str | None = None
    loop: str | None = None  # the loop's _target_: it declares the metrics' directions

    @property
    def seed(self) -> str | None:
        return next((value for key, value in map(_split, self.overrides) if key == SEED_KEY), None)


@dataclass(frozen=True)
class Group:
    """Jobs with the same overrides apart from ``seed``."""

    label: str  # the overrides that tell this group from the others
    jobs: tuple[JobRecord, ...]
    metric: str

    @property
    def values(self) -> list[float]:
        """The ranked metric of the members that report it."""
        return [v for j in self.jobs if (v := j.metrics.get(self.metric)) is not None]

    @property
    def missing(self) -> int:
        """Members without a value (e.g. a run that did not reach its target return)."""
        return len(self.jobs) - len(self.values)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    def median_of(self, metric: str) -> float | None:
        found = [v for j in self.jobs if (v := j.metrics.get(metric)) is not None]
        return statistics.median(found) if found else None


@dataclass(frozen=True)
class SweepReport:
    rank_by: str
    direction: Direction
    groups: tuple[Group, ...]  # best first
    failed: tuple[JobRecord, ...]
    columns: tuple[str, ...]  # further metrics shown per group (medians)


def read_jobs(entries: list[dict[str, Any]]) -> list[JobRecord]:
    """summary.json's job entries, each with the metrics of its ``result.json``."""
    jobs = []
    for entry in entries:
        result: dict[str, Any] = {}
        if entry.get("status") == "ok" and entry.get("result"):
            path = Path(entry["result"])
            if path.exists():
                result = json.loads(path.read_text())
        jobs.append(JobRecord(
            job=int(entry["job"]),
            overrides=tuple(entry.get("overrides") or ()),
            status=str(entry.get("status")),
            metrics=dict(result.get("metrics") or {}),
            error=entry.get("error"),
            loop=result.get("loop") or (result.get("summary") or {}).get("loop"),
        ))
    return jobs


def group_by_seed(jobs: list[JobRecord], metric: str) -> list[Group]:
    """Successful jobs grouped by their overrides without ``seed``, in job order; each label
    names only the overrides that vary across the sweep."""
    ok = [j for j in jobs if j.status == "ok"]
    keyed: dict[tuple[str, ...], list[JobRecord]] = {}
    for job in ok:
        keyed.setdefault(_without_seed(job.overrides), []).append(job)
    common = set.intersection(*(set(k) for k in keyed)) if keyed else set()
    return [
        Group(" ".join(o for o in key if o not in common) or "(all)", tuple(members), metric)
        for key, members in keyed.items()
    ]


def rank_groups(groups: list[Group], how: Direction) -> list[Group]:
    """Best first by median; groups with members lacking a value after those without, and
    groups with no value at all last."""

    def key(group: Group) -> tuple[int, float, int]:
        median = group.median
        if median is None:
            return (len(group.jobs) + 1, 0.0, group.jobs[0].job)
        return (group.missing, median if how == "min" else -median, group.jobs[0].job)

    return sorted(groups, key=key)


def build_report(
    jobs: list[JobRecord], rank_by: str | None = None, loop: str | None = None
) -> SweepReport:
    """Rank ``jobs`` by ``rank_by`` (default: the loop's first headline metric). The loop named
    by most jobs' results (else ``loop``, the sweep's configured one) gives the default and the
    columns; the metric's direction is what that loop, any job's loop or the app declares."""
    named = [j.loop for j in jobs if j.loop]
    loop = _most_common(named) or loop
    loops = (loop, *sorted(set(named) - {loop}))
    metric = rank_by or default_rank_by(loop)
    check_metric_name(metric, *loops)  # ConfigError: no loop here declares it
    how = direction(metric, *loops)
    groups = rank_groups(group_by_seed(jobs, metric), how)
    columns = tuple(m for m in headline(loop) if m != metric)
    failed = tuple(j for j in jobs if j.status != "ok")
    return SweepReport(metric, how, tuple(groups), failed, columns)


def format_table(report: SweepReport) -> str:
    """The ranked table as Markdown (``summary.md``; the multirun prints it too)."""
    better = "lower" if report.direction == "min" else "higher"
    head = ["rank", "config", "jobs", f"{report.rank_by} (median [min..max])", *report.columns]
    lines = [
        f"Ranked by `{report.rank_by}` ({better} is better); jobs that differ only in `seed` are "
        "one row; '-' means no value (e.g. target not reached).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for place, group in enumerate(report.groups, start=1):
        cells = [
            str(place),
            group.label,
            " ".join(f"#{j.job}" for j in group.jobs),
            _spread(group),
            *(_number(group.median_of(m)) for m in report.columns),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for job in report.failed:
        error = (job.error or "").strip().splitlines()
        cells = ["failed", " ".join(job.overrides) or "(no overrides)", f"#{job.job}",
                 (error[0] if error else "no error recorded")[:200]]
        cells += [""] * len(report.columns)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def report_json(report: SweepReport) -> dict[str, Any]:
    """The ranking for summary.json: groups best first, with their members and figures."""
    return {
        "rank_by": report.rank_by,
        "direction": report.direction,
        "ranking": [
            {
                "label": g.label,
                "jobs": [j.job for j in g.jobs],
                "seeds": [j.seed for j in g.jobs],
                "median": g.median,
                "min": min(g.values, default=None),
                "max": max(g.values, default=None),
                "without_value": g.missing,
            }
            for g in report.groups
        ],
        "failed": [j.job for j in report.failed],
    }


def _spread(group: Group) -> str:
    values = group.values
    if not values:
        return "-"
    text = _number(group.median)
    if len(values) > 1:
        text += f" [{_number(min(values))}..{_number(max(values))}]"
    if group.missing:
        text += f" ({group.missing} of {len(group.jobs)} without)"
    return text


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def _without_seed(overrides: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(o for o in overrides if _split(o)[0] != SEED_KEY)


def _most_common(items: list[str]) -> str | None:
    return Counter(items).most_common(1)[0][0] if items else None
