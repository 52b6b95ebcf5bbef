"""5. Start-up: ``python -m app plan_only=true`` against a trivial ``@hydra.main`` app that
imports torch (``benchmarks/tiny_hydra_app.py``), and against a bare
``python -c "import torch, hydra"``. Cold processes, interleaved, wall time of each.

Then the start-up of a real run, phase by phase, as the run recorded it (``result.json``'s
``phases``, app/output/timeline.py) over short default runs (apprun.SHORT_RUN): compose +
validate, spawn + import, rendezvous + groups, first update, and their sum, launch to first
update. Reported only: a regression shows in the phase it is in.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .apprun import STARTUP_PHASES, short_runs
from .core import Goal, Row, Settings, Stat, compare, interleave
from .procs import timed_command

NAME = "startup"
GOAL = Goal("<=", 1.3)
TIMEOUT_S = 120.0
PHASE_RUNS = {"full": 5, "quick": 2}  # short default runs for the phases


class Command:
    """One cold process per call; a Hydra app gets a fresh run folder each time."""

    def __init__(self, argv: list[str], run_dir: Path | None = None) -> None:
        self.argv, self.run_dir, self.calls = argv, run_dir, 0

    def __call__(self) -> float:
        self.calls += 1
        argv = list(self.argv)
        if self.run_dir is not None:
            argv.append(f"hydra.run.dir={self.run_dir}-{self.calls}")
        seconds, done = timed_command(argv, TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr[-2000:]}")
        return seconds


def commands(run_dir: Path) -> dict[str, Command]:
    py = sys.executable
    return {
        "app_plan_only": Command([py, "-m", "app", "plan_only=true"], run_dir / "app"),
        "tiny_hydra_app": Command([py, "-m", "benchmarks.tiny_hydra_app"], run_dir / "tiny"),
        "import_torch_hydra": Command([py, "-c", "import torch, hydra"]),
    }


def run(settings: Settings) -> list[Row]:
    run_dir = settings.out_dir / "startup"
    wanted = commands(run_dir)
    if settings.quick:  # only the comparison that has a goal
        del wanted["import_torch_hydra"]
    samples = interleave(wanted, settings.reps(5, 2), warmup=settings.reps(1, 0))
    rows = [
        compare(
            NAME,
            "python -m app plan_only=true vs trivial @hydra.main app + torch",
            samples,
            "app_plan_only",
            "tiny_hydra_app",
            GOAL,
        )
    ]
    if "import_torch_hydra" in samples:
        rows.append(
            compare(
                NAME,
                "python -m app plan_only=true vs python -c 'import torch, hydra'",
                samples,
                "app_plan_only",
                "import_torch_hydra",
            )
        )
    return rows + phase_rows(settings)


def phase_rows(settings: Settings) -> list[Row]:
    """One row per start-up phase of the default run, from what the runs recorded."""
    wanted = PHASE_RUNS["quick" if settings.quick else "full"]
    runs, note = short_runs(settings, wanted)
    finished = [run for run in runs if run.result is not None][:wanted]
    problems = [run.problem for run in runs if run.problem]
    prefix = "default run start-up"
    if not finished:
        why = problems[0] if problems else note or "no run"
        return [Row(NAME, f"{prefix} (phases)", status="failed", note=why)]
    note = "; ".join(filter(None, [f"{len(finished)} short default runs (result.json phases)",
                                   note, *problems[:1]]))
    rows = []
    for key, label in STARTUP_PHASES.items():
        values = [v for run in finished if (v := run.phases.get(key)) is not None]
        row = Row(NAME, f"{prefix}: {label}", note=note)
        if values:
            row.rlcomm = Stat.of(values)
        else:
            row.status, row.note = "skipped", f"no {key} in result.json's phases"
        rows.append(row)
    totals = [t for run in finished if (t := run.launch_to("first_update")) is not None]
    total = Row(NAME, f"{prefix}: launch to first update (sum)", note=note)
    if totals:
        total.rlcomm = Stat.of(totals)
    else:
        total.status, total.note = "skipped", "no first_update mark in result.json's timeline"
    return [*rows, total]
