"""14. Where the replay lives: ``python -m app loop=dqn`` on CartPole-v1 with the replay beside
the trainer (a shard per trainer: trainer 0 and static rollout ranks 1, 2) against the replay on
its own rank (``layout=replay_server``: trainer 0, replay rank 1, rollout ranks 2, 3), the same
two collectors and the same env steps (``BUDGET``, ``loop.stop_at_target=false``), each seed's
pair back to back. Rows: env steps/s and learner updates/s (learner steps over the run's wall
time, from metrics.csv) of each layout, median of the seeds, and their per-seed ratio
(docs/off-policy.md, "Which is faster").

``python -m benchmarks.replay_layouts [--budget N] [--seeds 0,1]`` prints the same figures
without the rest of the suite (alone on the machine, as every benchmark).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

from .core import PER_SECOND, Row, Settings
from .procs import CommandTimeoutError, timed_command

NAME = "replay_layouts"
SEEDS = (0, 1, 2)
BUDGET = 20_480  # env steps: 160 segments of 128
RUN_TIMEOUT_S = 300.0
# Layout overrides of each side: the same trainer and the same two collectors.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "colocated": ("layout.world_size=3", "layout.trainers=[0]", "layout.rollouts=[1,2]",
                  "layout.elastic_rollouts=false"),
    "replay rank": ("layout=replay_server",),
}


def run_one(layout: str, seed: int, budget: int, run_dir: Path) -> dict[str, float] | None:
    """Env steps/s and learner updates/s of one run, or None when it failed."""
    argv = [sys.executable, "-m", "app", "loop=dqn", *LAYOUTS[layout], f"seed={seed}",
            f"loop.total_env_steps={budget}", "loop.stop_at_target=false",
            "loop.progress=false", "loop.checkpoint_every=0", f"hydra.run.dir={run_dir}"]
    try:
        _, done = timed_command(argv, RUN_TIMEOUT_S)
    except CommandTimeoutError:
        return None
    result_file, metrics_file = run_dir / "result.json", run_dir / "metrics.csv"
    if done.returncode != 0 or not result_file.exists() or not metrics_file.exists():
        return None
    rank0 = json.loads(result_file.read_text())["ranks"][0]["result"]
    with metrics_file.open() as handle:
        rows = list(csv.DictReader(handle))
    learner_steps = sum(float(r["learner_steps"]) for r in rows)
    wall = float(rows[-1]["wall_s"]) if rows else 0.0
    return {"env_steps_per_s": float(rank0["env_steps_per_s"]),
            "updates_per_s": learner_steps / wall if wall > 0 else 0.0}


def measure(seeds: tuple[int, ...], budget: int,
            base: Path) -> dict[str, list[dict[str, float] | None]]:
    found: dict[str, list[dict[str, float] | None]] = {name: [] for name in LAYOUTS}
    for seed in seeds:  # both layouts next to each other, so drift between seeds cancels
        for name in LAYOUTS:
            slug = name.replace(" ", "_")
            found[name].append(run_one(name, seed, budget, base / f"{slug}_s{seed}"))
    return found


def rows_of(found: dict[str, list[dict[str, float] | None]], seeds: tuple[int, ...],
            budget: int) -> list[Row]:
    rows = []
    for figure, label in (("env_steps_per_s", "env steps/s"),
                          ("updates_per_s", "learner updates/s")):
        row = Row(NAME, f"DQN CartPole {label}: replay rank vs colocated", unit=PER_SECOND,
                  reference_name="colocated replay (a shard per trainer)")
        apart = [r[figure] if r else None for r in found["replay rank"]]
        beside = [r[figure] if r else None for r in found["colocated"]]
        row.set_per_seed(apart, beside)
        row.note = f"median of seeds {list(seeds)}, {budget:,} env steps each, 2 collectors"
        row.extra.update(per_seed={"replay rank": apart, "colocated": beside})
        rows.append(row)
    return rows


def run(settings: Settings) -> list[Row]:
    seeds = SEEDS[:1] if settings.quick else SEEDS
    return rows_of(measure(seeds, BUDGET, settings.out_dir / NAME), seeds, BUDGET)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replay_layouts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=BUDGET, help="env steps per run")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                        help="comma-separated seeds")
    args = parser.parse_args(argv)
    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    with tempfile.TemporaryDirectory(prefix="replay_layouts_") as tmp:
        found = measure(seeds, args.budget, Path(tmp))
    print(f"{'layout':<12} {'seed':>4} {'env steps/s':>12} {'updates/s':>10}")
    for name, runs in found.items():
        for seed, run_figures in zip(seeds, runs):
            if run_figures is None:
                print(f"{name:<12} {seed:>4} {'failed':>12}")
                continue
            print(f"{name:<12} {seed:>4} {run_figures['env_steps_per_s']:>12.1f} "
                  f"{run_figures['updates_per_s']:>10.1f}")
    for row in rows_of(found, seeds, args.budget):
        ratio = f"{row.ratio.median:.2f}" if row.ratio else "-"
        print(f"{row.name}: ratio {ratio}")


if __name__ == "__main__":
    main()
