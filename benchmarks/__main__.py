"""``python -m benchmarks [--quick] [--only NAME[,NAME]]``: run the comparisons, print the table,
and write ``outputs/bench/<timestamp>/results.json`` and ``results.md``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path

from .core import Row, Settings
from .procs import REPO_ROOT
from .report import environment, table, write

# In run order; each module has NAME and run(settings) -> list[Row].
SECTIONS = (
    "weight_transfer",
    "collectives",
    "group_setup",
    "scale",
    "startup",
    "wind_down",
    "rl_throughput",
    "rl_staleness",
    "flight",
    "mujoco",
    "elastic",
    "membership_scale",
    "sharding",
    "evaluation",
    "replay_layouts",
    "learner_speed",
    "trainer_loss",
    "seeds",
    "long_run",
    "ray",
    "growth",
)
# Run only when named (--only): hours of side-by-side runs against CleanRL's scripts, minutes
# of runs that each lose a trainer, half an hour (or more, under load) of every shipped
# configuration over ten seeds, the long runs (an hour and more), and minutes of thousands of
# simulated members that take both cores (and load the machine for a while after).
ONLY_BY_NAME = ("learner_speed", "trainer_loss", "seeds", "long_run", "membership_scale",
                "ray", "growth")
NOT_IN_QUICK = ("rl_throughput", "rl_staleness", "mujoco", "elastic", "evaluation",
                "replay_layouts")
BUDGET_S = {"quick": 115.0, "full": 570.0}  # the goals: under 2 and under 10 minutes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    parser.add_argument(
        "--only",
        metavar="NAME[,NAME]",
        type=lambda s: [name.strip() for name in s.split(",") if name.strip()],
        help=f"comma-separated sections among: {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--cleanrl", metavar="PPO_PY", type=Path,
        help="CleanRL's ppo.py: rl_throughput then also times it to return 475 (the reference "
        "of the default run's launch-to-exit goal); learner_speed runs its siblings",
    )
    parser.add_argument(
        "--cleanrl-python", metavar="PYTHON",
        help="the Python to run --cleanrl with (one with CleanRL's own requirements; "
        "default: this one)",
    )
    args = parser.parse_args(argv)
    if args.cleanrl is not None and not args.cleanrl.is_file():
        parser.error(f"--cleanrl: {args.cleanrl} is not a file")
    unknown = sorted(set(args.only or ()) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    return args


def selected(args: argparse.Namespace) -> list[str]:
    if args.only:
        return [name for name in SECTIONS if name in args.only]
    return [name for name in SECTIONS
            if name not in ONLY_BY_NAME and not (args.quick and name in NOT_IN_QUICK)]


def run_section(name: str, settings: Settings) -> tuple[list[Row], float]:
    """The section's rows, or one failed row with the error: a broken section does not stop
    the others."""
    start = time.perf_counter()
    try:
        module = importlib.import_module(f".{name}", __package__)
        rows: list[Row] = module.run(settings)
    except Exception as err:
        traceback.print_exc()
        rows = [Row(name, "(section)", status="failed", note=f"{type(err).__name__}: {err}")]
    return rows, time.perf_counter() - start


def _load() -> str:
    """The 1/5/15-minute load averages: other processes on the machine disturb every timing."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    budget = BUDGET_S["quick" if args.quick else "full"]
    settings = Settings(
        quick=args.quick,
        out_dir=REPO_ROOT / "outputs" / "bench" / stamp,
        deadline=time.monotonic() + budget,
        cleanrl=args.cleanrl.resolve() if args.cleanrl else None,
        cleanrl_python=args.cleanrl_python,
    )
    started = time.perf_counter()
    load_at_start = _load()
    rows: list[Row] = []
    durations: dict[str, float] = {}
    for name in selected(args):
        print(f"== {name} ...", flush=True)
        section_rows, durations[name] = run_section(name, settings)
        rows += section_rows
        print(table(section_rows), f"\n({durations[name]:.1f} s)\n", flush=True)
    meta = {
        "timestamp": stamp,
        "load_average_at_start": load_at_start,
        "load_average_at_end": _load(),
        "mode": "quick" if args.quick else "full",
        "sections": list(durations),
        "section_seconds": durations,
        "total_seconds": round(time.perf_counter() - started, 1),
        "environment": environment(),
    }
    write(rows, meta, settings.out_dir)
    print(table(rows))
    missed = [row for row in rows if row.met == "no"]
    print(
        f"\n{len(rows)} rows, {len(missed)} goal(s) missed, "
        f"{sum(r.status == 'failed' for r in rows)} failed; total {meta['total_seconds']} s; "
        f"results in {settings.out_dir}"
    )
    return 1 if any(row.status == "failed" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
