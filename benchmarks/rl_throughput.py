"""6. RL throughput and time to answer: the default PPO run (``python -m app loop=ppo``: trainers
0,1 each feeding a rollout worker) against ``python -m app loop=ppo layout=single`` (one
colocated rank), and, with ``--cleanrl PPO_PY``, against CleanRL's ``ppo.py`` (one process), side
by side: for each seed of ``SEEDS``, one run of each, in alternating order.

Each app run is a subprocess with its own ``hydra.run.dir`` under this benchmark's output
folder; its metrics come from ``<run dir>/result.json`` (looked up by key pattern, so the loop
may nest them), its wall time is launch to exit (the run stops itself at return 475). CleanRL's
``ppo.py`` runs a fixed budget: it is timed from launch to the moment the mean of its last 20
printed episodic returns reaches 475, and stopped there. A run that exceeds its share of the
time budget (with ``--cleanrl``: ``RUN_TIMEOUT_S``, outside the shared budget; about 4 minutes in
all on an idle 2-core machine) is killed; its env steps/s then come from the last progress line
it printed.
Without a ``loop=ppo`` config the rows are skipped.

Goals: the default run's launch to exit <= 0.25 x CleanRL's launch to return 475, and <= the
one-rank layout's (median of the per-seed ratios).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .apprun import run_to_target
from .core import NUMBER, PER_SECOND, SECONDS, Goal, Row, Settings, Stat, ratios
from .procs import CommandTimeoutError, timed_command

NAME = "rl_throughput"
RUN_TIMEOUT_S = 300.0  # per run at most; less when the run's 10-minute budget has less left
MIN_RUN_S = 30.0  # below this much time per run, the runs are skipped
SEEDS = (1, 2, 3)
RUNS = {"default": ["loop=ppo"], "single": ["loop=ppo", "layout=single"]}
CLEANRL = "cleanrl"
TARGET_RETURN, WINDOW = 475.0, 20  # CartPole-v1's reward threshold, the app's stop rule
WALL = "wall time (launch to exit)"
GOALS = {"single": Goal("<=", 1.0), CLEANRL: Goal("<=", 0.25)}

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
    metrics = {WALL: seconds}
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


def run_cleanrl(settings: Settings, seed: int, work_dir: Path, timeout: float) -> Outcome:
    """CleanRL's ppo.py (``settings.cleanrl``), launch to return 475, in ``work_dir`` (it writes
    its TensorBoard runs there)."""
    assert settings.cleanrl is not None
    work_dir.mkdir(parents=True, exist_ok=True)
    python = settings.cleanrl_python or sys.executable
    timed = run_to_target([python, str(settings.cleanrl), "--seed", str(seed)], work_dir,
                          TARGET_RETURN, WINDOW, timeout)
    if timed.seconds is None:
        return Outcome(problem=timed.problem)
    return Outcome({WALL: timed.seconds})


def run(settings: Settings) -> list[Row]:
    base = settings.out_dir / "rl"
    ok, why = ppo_available(base / "probe")
    if not ok:
        note = f"skipped: loop=ppo not available ({why})"
        return [Row(NAME, "default PPO run vs layout=single", status="skipped", note=note)]
    kinds = [*RUNS, *([CLEANRL] if settings.cleanrl else [])]
    outcomes: dict[str, list[Outcome]] = {kind: [] for kind in kinds}
    left = len(kinds) * len(SEEDS)
    for index, seed in enumerate(SEEDS):
        for kind in (kinds if index % 2 == 0 else kinds[::-1]):  # alternating order
            # With CleanRL (about a minute per run) the section cannot fit the shared budget:
            # each run then gets RUN_TIMEOUT_S, as rl_staleness's do.
            share = RUN_TIMEOUT_S if settings.cleanrl else settings.seconds_left() / left
            timeout = min(RUN_TIMEOUT_S, share)
            left -= 1
            if timeout < MIN_RUN_S:
                problem = f"only {timeout:.0f} s of the time budget left"
                outcomes[kind].append(Outcome(problem=problem, status="skipped"))
            elif kind == CLEANRL:
                outcomes[kind].append(run_cleanrl(settings, seed, base / f"cleanrl-{seed}", timeout))
            else:
                outcomes[kind].append(
                    run_app([*RUNS[kind], f"seed={seed}"], base / f"{kind}-{seed}", timeout))
    rows = [
        Row(NAME, f"{kind} run, seed {seed}", status=outcome.status, note=outcome.problem)
        for kind, runs in outcomes.items()
        for seed, outcome in zip(SEEDS, runs)
        if outcome.problem
    ]
    units = {WALL: SECONDS, **{m: u for m, (u, _) in METRICS.items()}}
    for metric, unit in units.items():
        rows.append(_metric_row(metric, unit, outcomes["default"], outcomes["single"], "single"))
    if CLEANRL in outcomes:
        rows.append(_metric_row(WALL, SECONDS, outcomes["default"], outcomes[CLEANRL], CLEANRL,
                                name="default run launch to exit vs CleanRL ppo.py launch to "
                                "return 475"))
    return rows


def _metric_row(metric: str, unit: str, default: list[Outcome], other: list[Outcome],
                kind: str, name: str = "") -> Row:
    """default (rlcomm's layout) against ``kind`` over the seeds; the ratio over the seeds both
    have; one side only when the other has no value."""
    reference = "layout=single" if kind == "single" else "CleanRL ppo.py"
    row = Row(NAME, name or f"{metric}: default vs {kind}", unit=unit, reference_name=reference,
              goal=GOALS.get(kind) if metric == WALL else None)
    ours = [o.metrics.get(metric) for o in default]
    theirs = [o.metrics.get(metric) for o in other]
    mine = [v for v in ours if v is not None]
    refs = [v for v in theirs if v is not None]
    if mine:
        row.rlcomm = Stat.of(mine)
    if refs:
        row.reference = Stat.of(refs)
    pairs = [(a, b) for a, b in zip(ours, theirs) if a is not None and b]
    if pairs:
        row.ratio = ratios([a for a, _ in pairs], [b for _, b in pairs])
        row.note = f"{len(pairs)} seed(s) of {list(SEEDS)} with both"
    elif not mine and not refs:
        row.status, row.note = "skipped", "no value in any run"
    else:
        missing, runs = (kind, other) if not refs else ("default", default)
        why = next((o.problem for o in runs if o.problem), "") or next(
            (o.not_reached for o in runs if o.not_reached and "475" in metric), ""
        ) or "not in its result.json"
        row.note = f"no {missing} value: {why}"
        if row.goal is not None:
            row.status = "failed" if any(o.problem for o in runs) else "skipped"
    return row
