"""13. What evaluation beside training costs: ``python -m app`` on a fixed budget with
``loop.eval_every=0`` against ``loop.eval_every=EVERY`` (10 greedy CartPole episodes in the
lead trainer's background process, docs/evaluate.md), on one process (``single``) and on the
default layout (``2t2r``), each with the same ``SEEDS``, run next to each other. Rows: env
steps/s of each side (median of the seeds, with min and max) and their per-seed ratio; the goal
is the issue's, evaluation on within 5% of off.

Twelve runs of 10-20 s each; on a 2-core machine the evaluation process shares the cores with
every rank, which is what is measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .core import PER_SECOND, Goal, Row, Settings
from .procs import CommandTimeoutError, timed_command

NAME = "evaluation"
SEEDS = (0, 1, 2)
LAYOUTS = ("single", "2t2r")
EVERY = 5
BUDGET = 61_440  # env steps: 60 updates on single, 30 on 2t2r
RUN_TIMEOUT_S = 180.0


def run_one(layout: str, every: int, seed: int, run_dir: Path) -> float | None:
    """Rank 0's env steps/s over the whole budget, or None when the run failed."""
    argv = [
        sys.executable, "-m", "app", f"layout={layout}", f"seed={seed}",
        f"loop.eval_every={every}", f"loop.total_env_steps={BUDGET}", "loop.stop_at_target=false",
        "loop.progress=false", "loop.checkpoint_every=0", f"hydra.run.dir={run_dir}",
    ]
    try:
        _, done = timed_command(argv, RUN_TIMEOUT_S)
    except CommandTimeoutError:
        return None
    result_file = run_dir / "result.json"
    if done.returncode != 0 or not result_file.exists():
        return None
    result = json.loads(result_file.read_text())
    return float(result["ranks"][0]["result"]["env_steps_per_s"])


def run(settings: Settings) -> list[Row]:
    base = settings.out_dir / NAME
    rows = []
    for layout in LAYOUTS:
        found: dict[tuple[int, int], float | None] = {}
        for seed in SEEDS:  # on and off next to each other, so drift between seeds cancels
            for every in (0, EVERY):
                found[(every, seed)] = run_one(layout, every, seed, base / f"{layout}_e{every}_s{seed}")
        rows.append(_row(layout, found))
    return rows


def _row(layout: str, found: dict[tuple[int, int], float | None]) -> Row:
    row = Row(NAME, f"{layout} env steps/s: eval_every={EVERY} vs 0", unit=PER_SECOND,
              reference_name="no evaluation", goal=Goal(">=", 0.95))
    on = [found[(EVERY, s)] for s in SEEDS]
    off = [found[(0, s)] for s in SEEDS]
    row.set_per_seed(on, off)
    row.note = f"median of seeds {list(SEEDS)}, {BUDGET:,} env steps each"
    row.extra.update(per_seed={"on": on, "off": off})
    return row
