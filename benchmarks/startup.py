"""5. Start-up: ``python -m app plan_only=true`` against a trivial ``@hydra.main`` app that
imports torch (``benchmarks/tiny_hydra_app.py``), and against a bare
``python -c "import torch, hydra"``. Cold processes, interleaved, wall time of each.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .core import Goal, Row, Settings, compare, interleave
from .procs import timed_command

NAME = "startup"
GOAL = Goal("<=", 1.3)
TIMEOUT_S = 120.0


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
    return rows
