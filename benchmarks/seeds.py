"""``--only seeds``: every shipped configuration over ten seeds.

Each configuration is a documented command (README, "A few commands"), run as a user runs it,
on its defaults (its budget, its layout, its checkpoints), once per seed, one run at a time:
``python -m app OVERRIDES seed=S``. The issue's layout, ``1t3r``, is reported beside the
default-layout commands as variants (the lockstep run there is the asynchronous runs'
baseline). Per configuration it reports the solved fraction (the target reached within the
budget), the interquartile mean and the median of the env steps and of the training time to the
target over the solved seeds, each with a 95% stratified-bootstrap confidence interval
(benchmarks/aggregates.py), and one learning-curve picture with every seed and the spread
(benchmarks/seeds_report.py). The 1-minute load average is read before and after every run.

Half an hour on 2 idle cores, over an hour under load (DQN and SAC are most of it), so it
runs only when named. Alone, with a choice of configurations and seeds, and resumable (a run
dir that holds a ``result.json`` is read, not run again)::

    python -m benchmarks.seeds [--configs ppo,sac] [--seeds 0-9] [--out DIR] [--override K=V]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .apprun import run_app
from .core import NUMBER, SECONDS, Goal, Row, Settings, Stat
from .procs import REPO_ROOT
from .report import environment

NAME = "seeds"
SEEDS = tuple(range(10))
RUN_TIMEOUT_S = 1800.0  # a run that has not ended by then is killed and counted as not solved


@dataclass(frozen=True)
class Config:
    """A shipped configuration: its documented command's overrides."""

    name: str
    overrides: tuple[str, ...]
    words: str
    variant: bool = False  # reported beside a documented command, not instead of one

    @property
    def command(self) -> str:
        return " ".join(("python -m app", *self.overrides))


CONFIGS = (
    Config("ppo", (), "PPO, CartPole-v1 (the default)"),
    Config("ppo_async", ("loop.max_staleness=1",), "asynchronous PPO, CartPole-v1"),
    Config("vtrace", ("loop=vtrace", "loop.max_staleness=1"), "V-trace, CartPole-v1"),
    Config("dqn", ("loop=dqn",), "DQN, CartPole-v1"),
    Config("sac", ("loop=sac",), "SAC, Pendulum-v1"),
    Config("ppo_1t3r", ("layout=1t3r",), "PPO on 1t3r, lockstep", variant=True),
    Config("ppo_async_1t3r", ("layout=1t3r", "loop.max_staleness=1"),
           "asynchronous PPO on 1t3r", variant=True),
    Config("vtrace_1t3r", ("layout=1t3r", "loop=vtrace", "loop.max_staleness=1"),
           "V-trace on 1t3r", variant=True),
)
BY_NAME = {config.name: config for config in CONFIGS}
# The goals (#64): on 1t3r, asynchronous PPO and V-trace solve at least 9 seeds of 10,
# and asynchronous PPO's median env steps to the target are within 1.25x the lockstep run's.
SOLVED_GOALS = {"ppo_async_1t3r": 0.9, "vtrace_1t3r": 0.9}
STEPS_GOAL = ("ppo_async_1t3r", "ppo_1t3r", 1.25)


@dataclass
class SeedRun:
    """One configuration's run of one seed, as its run dir recorded it."""

    config: str
    seed: int
    solved: bool = False
    env_steps_to_target: int | None = None
    time_to_target_s: float | None = None  # from the training loop's start (summary)
    final_mean_return: float | None = None
    env_steps: int | None = None  # collected when the run stopped
    budget: int | None = None  # loop.total_env_steps
    target: float | None = None
    wall_s: float | None = None  # launch to exit (None when read back from an earlier run)
    load_before: float | None = None
    load_after: float | None = None
    problem: str = ""  # why the run has no result ("" when it has one)
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # steps, wall, return

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "curve"}


def load_1min() -> float:
    return os.getloadavg()[0]


def read_run(config: str, seed: int, run_dir: Path) -> SeedRun:
    """What ``run_dir`` recorded: its summary, its budget and its learning curve."""
    run = SeedRun(config, seed)
    result = json.loads((run_dir / "result.json").read_text())
    summary = result["summary"]
    run.solved = bool(summary["solved"])
    run.env_steps_to_target = summary["env_steps_to_target"]
    run.time_to_target_s = summary["time_to_target_s"]
    run.final_mean_return = summary["final_mean_return"]
    run.env_steps = summary["env_steps"]
    run.target = summary["target_return"]
    hydra_config = run_dir / ".hydra" / "config.yaml"
    if hydra_config.exists():
        run.budget = int(OmegaConf.load(hydra_config).loop.total_env_steps)
    with (run_dir / "metrics.csv").open() as handle:
        run.curve = [(int(r["env_steps"]), float(r["wall_s"]), float(r["return_window"]))
                     for r in csv.DictReader(handle) if r["return_window"] not in ("", "nan")]
    return run


def run_seed(config: Config, seed: int, out: Path, overrides: Sequence[str] = ()) -> SeedRun:
    """``config``'s command for ``seed`` into ``out/<config>/seed<S>``, with the loads before and
    after it beside it (``seed<S>.json``). A run dir that already holds a result is read back
    instead (a resumed benchmark); one left unfinished is moved aside, never overwritten."""
    run_dir = out / config.name / f"seed{seed}"
    record = run_dir.parent / f"seed{seed}.json"
    if (run_dir / "result.json").exists():
        run = read_run(config.name, seed, run_dir)
        if record.exists():
            saved = json.loads(record.read_text())
            run.wall_s, run.load_before, run.load_after = (
                saved.get("wall_s"), saved.get("load_before"), saved.get("load_after"))
        return run
    if run_dir.exists():
        run_dir.rename(run_dir.with_name(f"{run_dir.name}.unfinished-{time.time_ns()}"))
    before = load_1min()
    app_run = run_app([*config.overrides, *overrides, f"seed={seed}"], run_dir, RUN_TIMEOUT_S)
    if app_run.result is None:
        run = SeedRun(config.name, seed, problem=app_run.problem)
    else:
        run = read_run(config.name, seed, run_dir)
    run.wall_s, run.load_before, run.load_after = round(app_run.wall_s, 2), before, load_1min()
    record.write_text(json.dumps(run.as_dict(), indent=1))
    return run


def run_configs(configs: Sequence[Config], seeds: Sequence[int], out: Path,
                overrides: Sequence[str] = ()) -> dict[str, list[SeedRun]]:
    """Every configuration's seeds, one run at a time, in order."""
    found: dict[str, list[SeedRun]] = {}
    for config in configs:
        found[config.name] = []
        for seed in seeds:
            run = run_seed(config, seed, out, overrides)
            found[config.name].append(run)
            outcome = (f"solved at {run.env_steps_to_target:,} env steps" if run.solved
                       else f"not solved ({run.problem or f'final {run.final_mean_return}'})")
            print(f"{config.name} seed {seed}: {outcome}, load {run.load_before}", flush=True)
    return found


def rows_of(found: dict[str, list[SeedRun]]) -> list[Row]:
    """The benchmarks table's rows: per configuration, the solved fraction and the env steps and
    training time to the target (solved seeds: median [min..max]); the issue's goals."""
    rows = []
    for name, runs in found.items():
        solved = [r for r in runs if r.solved]
        budget = next((r.budget for r in runs if r.budget), None)
        fraction = Row(NAME, f"{name}: solved fraction", unit=NUMBER,
                       rlcomm=Stat.single(len(solved) / len(runs)),
                       note=f"{len(solved)} of {len(runs)} seeds within {budget or '?'} env steps")
        if name in SOLVED_GOALS:
            fraction.goal = Goal(">=", SOLVED_GOALS[name], on="value")
        rows.append(fraction)
        for what, unit in (("env_steps_to_target", NUMBER), ("time_to_target_s", SECONDS)):
            values = [float(getattr(r, what)) for r in solved]
            row = Row(NAME, f"{name}: {what.replace('_', ' ')} (solved seeds)", unit=unit,
                      note=f"median [min..max] of {len(values)} solved seeds")
            if values:
                row.rlcomm = Stat.of(values)
            else:
                row.status = "skipped"
            rows.append(row)
    ours, theirs, bound = STEPS_GOAL
    steps = {n: [float(r.env_steps_to_target) for r in found.get(n, [])
                 if r.env_steps_to_target is not None] for n in (ours, theirs)}
    if all(steps.values()):
        row = Row(NAME, f"{ours} / {theirs}: median env steps to target", unit=NUMBER,
                  rlcomm=Stat.of(steps[ours]), reference=Stat.of(steps[theirs]),
                  goal=Goal("<=", bound), reference_name=theirs,
                  note="ratio of the medians over each configuration's solved seeds")
        row.ratio = Stat.single(row.rlcomm.median / row.reference.median)  # type: ignore[union-attr]
        rows.append(row)
    return rows


def run(settings: Settings) -> list[Row]:
    """The section in ``python -m benchmarks --only seeds``: every configuration, ten seeds."""
    from .seeds_report import write_report

    out = settings.out_dir / NAME
    found = run_configs(CONFIGS, SEEDS, out)
    write_report(found, CONFIGS, out, meta(out, ()))
    return rows_of(found)


def meta(out: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """What the page says of the machine and the measurement."""
    return {"date": f"{date.today():%Y-%m-%d}", "out": str(out), "overrides": list(overrides),
            "environment": environment(), "load_at_report": round(load_1min(), 2)}


def parse_seeds(text: str) -> list[int]:
    """``0-9`` or ``0,2,5`` (or both, ``0-3,7``) as a list of seeds."""
    seeds: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        seeds += range(int(low), int(high or low) + 1)
    return seeds


def main(argv: list[str] | None = None) -> int:
    from .seeds_report import write_report

    parser = argparse.ArgumentParser(prog="python -m benchmarks.seeds", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(BY_NAME),
                        help=f"comma-separated, among: {', '.join(BY_NAME)}")
    parser.add_argument("--seeds", type=parse_seeds, default=list(SEEDS), help="e.g. 0-9")
    parser.add_argument("--out", type=Path, help="run dirs and the report (default: "
                        "outputs/bench/seeds-<timestamp>/); an existing one resumes")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="added to every run's command (a smoke: loop.total_env_steps=...)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.configs.split(",") if n not in BY_NAME]
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    configs = [BY_NAME[n] for n in args.configs.split(",")]
    out = args.out or REPO_ROOT / "outputs" / "bench" / f"seeds-{time.strftime('%Y-%m-%d_%H-%M-%S')}"
    found = run_configs(configs, args.seeds, out, args.override)
    page = write_report(found, configs, out, meta(out, args.override))
    print(page.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
