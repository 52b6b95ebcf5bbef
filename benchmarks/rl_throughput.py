"""6. RL throughput: the default PPO run (``python -m app loop=ppo``: trainers 0,1 each feeding a
rollout worker) against ``python -m app loop=ppo layout=single`` (one colocated rank).

Each run is a subprocess with its own ``hydra.run.dir`` under this benchmark's output folder;
its metrics come from ``<run dir>/result.json`` (looked up by key pattern, so the loop may nest
them). A run that exceeds its share of the time budget is killed; its env steps/s then come
from the last progress line it printed. Without a ``loop=ppo`` config the row is skipped.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core import NUMBER, PER_SECOND, SECONDS, Row, Settings, Stat, ratios
from .procs import CommandTimeoutError, timed_command

NAME = "rl_throughput"
RUN_TIMEOUT_S = 300.0  # per run at most; less when the run's 10-minute budget has less left
MIN_RUN_S = 30.0  # below this much time per run, the runs are skipped
RUNS = {"default": ["loop=ppo"], "single": ["loop=ppo", "layout=single"]}

# metric -> (unit, pattern of its key in result.json)
METRICS: dict[str, tuple[str, str]] = {
    "env steps/s": (PER_SECOND, r"(env_?)?steps?_per_s(ec(ond)?)?$|(^|_)sps$"),
    "time to return >= 475": (SECONDS, r"time_to_(return_?)?475|time_to_(solve|target)|solve_time"),
    "env steps to return >= 475": (NUMBER, r"env_steps_to_(target|solve|475)"),
    "weight-transfer share of trainer time": (NUMBER, r"(weight_)?transfer_?(share|fraction)"),
}
TARGET_METRIC = "time to return >= 475"
# The progress line off a terminal (app/output/progress.py): "..., 11,402 steps/s, weights v30, 0:10"
PROGRESS = re.compile(r"([\d,]+) steps/s, weights v\d+")


@dataclass
class Outcome:
    """One run: its metrics (name -> value) or why it has none."""

    metrics: dict[str, float] = field(default_factory=dict)
    problem: str = ""
    not_reached: str = ""  # why the time-to-target metrics are missing from a finished run
    status: str = "failed"  # the row status when there is a problem: failed, timeout, skipped


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``("ranks.0.result.sps", 123.0)`` for every leaf of a JSON document."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}{key}.")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from flatten(item, f"{prefix}{index}.")
    else:
        yield prefix.rstrip("."), value


def find_metric(result: dict[str, Any], pattern: str) -> float | None:
    """The first numeric leaf whose last key component matches ``pattern`` (rank 0 first)."""
    for path, value in flatten(result):
        key = path.rsplit(".", 1)[-1].lower()
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if numeric and re.search(pattern, key):
            return float(value)
    return None


def progress_rate(output: str) -> float | None:
    """Env steps/s from the last progress line of a run that was stopped."""
    found = PROGRESS.findall(output)
    return float(found[-1].replace(",", "")) if found else None


def ppo_available(run_dir: Path) -> tuple[bool, str]:
    """Whether ``loop=ppo`` composes and plans (a cheap ``plan_only`` run), and why not."""
    argv = [sys.executable, "-m", "app", "loop=ppo", "plan_only=true", f"hydra.run.dir={run_dir}"]
    _, done = timed_command(argv, 120.0)
    if done.returncode == 0:
        return True, ""
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    return False, lines[0] if lines else f"exit code {done.returncode}"


def run_app(overrides: list[str], run_dir: Path, timeout: float) -> Outcome:
    argv = [sys.executable, "-m", "app", *overrides, f"hydra.run.dir={run_dir}"]
    try:
        seconds, done = timed_command(argv, timeout)
    except CommandTimeoutError as err:
        outcome = Outcome(problem=f"did not finish within {timeout:.0f} s", status="timeout")
        rate = progress_rate(err.stderr)
        if rate is not None:
            outcome.metrics["env steps/s"] = rate
            outcome.problem += " (env steps/s from its progress bar)"
        return outcome
    result_file = run_dir / "result.json"
    if done.returncode != 0 or not result_file.exists():
        tail = " / ".join(done.stderr.strip().splitlines()[-3:])
        return Outcome(problem=f"failed with exit code {done.returncode}: {tail}"[:600])
    document = json.loads(result_file.read_text())
    metrics = {"wall time (launch to exit)": seconds}
    for metric, (_, pattern) in METRICS.items():
        value = find_metric(document, pattern)
        if value is not None:
            metrics[metric] = value
    outcome = Outcome(metrics)
    if TARGET_METRIC not in metrics:
        steps = find_metric(document, r"^env_steps$")
        outcome.not_reached = "the run ended without reaching the target return" + (
            f" ({steps:,.0f} env steps)" if steps is not None else ""
        )
    return outcome


def run(settings: Settings) -> list[Row]:
    base = settings.out_dir / "rl"
    ok, why = ppo_available(base / "probe")
    if not ok:
        note = f"skipped: loop=ppo not available ({why})"
        return [Row(NAME, "default PPO run vs layout=single", status="skipped", note=note)]
    outcomes: dict[str, Outcome] = {}
    for left, (name, overrides) in zip(range(len(RUNS), 0, -1), RUNS.items()):
        timeout = min(RUN_TIMEOUT_S, settings.seconds_left() / left)
        if timeout < MIN_RUN_S:
            problem = f"only {timeout:.0f} s of the time budget left"
            outcomes[name] = Outcome(problem=problem, status="skipped")
        else:
            outcomes[name] = run_app(overrides, base / name, timeout)
    rows = [
        Row(NAME, f"{name} PPO run", status=outcome.status, note=outcome.problem)
        for name, outcome in outcomes.items()
        if outcome.problem
    ]
    units = {"wall time (launch to exit)": SECONDS, **{m: u for m, (u, _) in METRICS.items()}}
    for metric, unit in units.items():
        rows.append(_metric_row(metric, unit, outcomes["default"], outcomes["single"]))
    return rows


def _metric_row(metric: str, unit: str, default: Outcome, single: Outcome) -> Row:
    """default (rlcomm's layout) against single; one side only when the other has no value."""
    ours, theirs = default.metrics.get(metric), single.metrics.get(metric)
    row = Row(NAME, f"{metric}: default vs single", unit=unit, reference_name="layout=single")
    if ours is not None:
        row.rlcomm = Stat.single(ours)
    if theirs is not None:
        row.reference = Stat.single(theirs)
    if ours is not None and theirs is not None:
        row.ratio = ratios([ours], [theirs]) if theirs else None
        row.note = "1 run each" + ("" if theirs else "; no ratio to a reference of 0")
    elif ours is None and theirs is None:
        row.status, row.note = "skipped", "no value in either run"
    else:
        missing, outcome = ("single", single) if theirs is None else ("default", default)
        why = outcome.problem or (
            outcome.not_reached if "475" in metric else "not in its result.json"
        )
        row.note = f"no {missing} value: {why}"
    return row
