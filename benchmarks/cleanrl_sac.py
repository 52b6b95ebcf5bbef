"""SAC against CleanRL's on the same machine: ``python -m benchmarks.cleanrl_sac
--cleanrl-script PATH [--cleanrl-python PYTHON] [--steps N] [--seeds S[,S]]``.

CleanRL is not part of this repository. Pass ``--cleanrl-script``, the path of
``cleanrl/sac_continuous_action.py`` in your checkout of CleanRL (it imports ``cleanrl_utils``
from the checkout's root, which this benchmark puts on its ``PYTHONPATH``), and
``--cleanrl-python``, a Python with CleanRL's own requirements (its
``requirements/requirements-mujoco.txt``: gymnasium 0.29.1 and mujoco, tyro, stable-baselines3,
tensorboard, torch). Under gymnasium 1.x the script prints no episodic returns (it reads 0.29's
``final_info``) and fails at the first time-limit cut (``final_observation``), so that Python
must be its own, not this project's. For example::

    git clone https://github.com/vwxyzjn/cleanrl ~/cleanrl
    python -m venv --system-site-packages ~/cleanrl-venv    # torch from this environment
    ~/cleanrl-venv/bin/pip install gymnasium==0.29.1 mujoco==2.3.7 numpy==1.26.4 \\
        stable-baselines3==2.3.2 tyro tensorboard

For each seed, back to back and alone on the machine, it runs:

1. CleanRL: ``PYTHON sac_continuous_action.py --env-id ENV --total-timesteps N --seed S
   --no-cuda --no-track --no-capture-video`` (its defaults otherwise: CleanRL's published
   settings), in its own directory under the benchmark's; the episodic returns come from its
   output (``episodic_return=``), or from its TensorBoard events when the output has none;
2. ours: ``python -m app +experiment=EXPERIMENT loop.total_env_steps=N seed=S`` (the default
   layout unless ``--layout``), with the returns from its ``metrics.csv`` and ``result.json``.

It prints, per side and seed: the wall time from launch to exit, the mean return of the last
``--last`` episodes (20), the episodes finished, env steps/s over the run, and the ratio of wall
times (ours / CleanRL; the issue's goal: <= 0.5 with the same return or better). The load
average before and after each run is shown too. Everything goes to
``outputs/bench/cleanrl-sac-<timestamp>/``: ``results.json``, ``results.md`` (the table) and
``learning_curves.png`` (the mean return of the last ``--last`` episodes against env steps and
against wall time, both sides, one line per seed).

``--learning-starts L`` passes CleanRL's ``--learning-starts L`` and our
``loop.replay.min_size=L``, for a smoke at a small budget (e.g. ``--steps 2000
--learning-starts 500``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .apprun import run_app
from .procs import REPO_ROOT, users_environment

# Our experiment -> the id CleanRL's script runs under gymnasium 0.29 (which has no v5).
CLEANRL_ENV = {"hopper_sac": "Hopper-v4", "halfcheetah_sac": "HalfCheetah-v4"}
EPISODE = re.compile(r"global_step=(\d+), episodic_return=\[?(-?[\d.eE+-]+)")
QUIET = ("loop.progress=false", "loop.checkpoint_every=0")


@dataclass
class Side:
    """One run of one side: its time, its returns (env step, wall seconds, return) and why it
    has none."""

    name: str
    seed: int
    wall_s: float | None = None
    env_steps: int | None = None
    episodes: list[tuple[float, float, float]] = field(default_factory=list)
    final_return: float | None = None  # mean of the last ``last`` episodes
    load: tuple[float, float] = (0.0, 0.0)
    problem: str = ""

    @property
    def steps_per_s(self) -> float | None:
        return self.env_steps / self.wall_s if self.env_steps and self.wall_s else None


def parse_episodes(lines: list[tuple[float, str]]) -> list[tuple[float, float, float]]:
    """CleanRL's ``global_step=G, episodic_return=[R]`` lines (with the seconds since launch
    each was read at) as (G, seconds, R)."""
    found = []
    for seconds, line in lines:
        match = EPISODE.search(line)
        if match:
            found.append((float(match.group(1)), seconds, float(match.group(2))))
    return found


def tensorboard_episodes(directory: Path) -> list[tuple[float, float, float]]:
    """``charts/episodic_return`` from the TensorBoard events under ``directory`` as (step,
    seconds since the first event, return); empty when there are none, or without this
    project's ``tensorboard`` extra to read them."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return []

    found: list[tuple[float, float, float]] = []
    for events in sorted(directory.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "charts/episodic_return" not in accumulator.Tags().get("scalars", []):
            continue
        scalars = accumulator.Scalars("charts/episodic_return")
        start = scalars[0].wall_time if scalars else 0.0
        found += [(float(s.step), s.wall_time - start, float(s.value)) for s in scalars]
    return found


def mean_last(episodes: list[tuple[float, float, float]], last: int) -> float | None:
    recent = [r for _, _, r in episodes[-last:]]
    return sum(recent) / len(recent) if recent else None


def run_cleanrl(args: argparse.Namespace, seed: int, out: Path) -> Side:
    """CleanRL's script for ``args.steps`` env steps, timed from launch to exit."""
    side = Side("CleanRL", seed)
    workdir = out / f"cleanrl_s{seed}"
    workdir.mkdir(parents=True)
    argv = [args.cleanrl_python, str(args.cleanrl_script), "--env-id", args.env_id,
            "--total-timesteps", str(args.steps), "--seed", str(seed), "--no-cuda",
            "--no-track", "--no-capture-video"]
    if args.learning_starts is not None:
        argv += ["--learning-starts", str(args.learning_starts)]
    env = users_environment()
    checkout = args.cleanrl_script.resolve().parent.parent  # cleanrl_utils lives there
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # each return line as printed, for the curve against time
    lines: list[tuple[float, str]] = []
    before = os.getloadavg()[0]
    started = time.monotonic()
    with (workdir / "stdout.txt").open("w") as log:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        assert proc.stdout is not None
        for line in proc.stdout:  # stamped as read, for the curve against wall time
            lines.append((time.monotonic() - started, line))
            log.write(line)
        code = proc.wait()
    side.wall_s = round(time.monotonic() - started, 2)
    side.load = (before, os.getloadavg()[0])
    side.episodes = parse_episodes(lines) or tensorboard_episodes(workdir / "runs")
    side.final_return = mean_last(side.episodes, args.last)
    if code != 0:
        tail = " / ".join(line.strip() for _, line in lines[-3:])
        side.problem = f"exit code {code}: {tail}"[:600]
    else:
        side.env_steps = args.steps
        if not side.episodes:
            side.problem = ("it printed no episodic returns: run it with CleanRL's own "
                            "requirements (gymnasium 0.29), --cleanrl-python")
    return side


def our_overrides(args: argparse.Namespace, seed: int) -> list[str]:
    """Our side's command line: the experiment, the budget and what the options add."""
    overrides = [f"+experiment={args.experiment}", f"loop.total_env_steps={args.steps}",
                 f"seed={seed}", f"loop.window={args.last}", *QUIET]
    if args.layout:
        overrides.append(f"layout={args.layout}")
    if args.threads is not None:
        overrides.append(f"loop.threads={args.threads}")
    if args.learning_starts is not None:
        overrides.append(f"loop.replay.min_size={args.learning_starts}")
    return overrides


def run_ours(args: argparse.Namespace, seed: int, out: Path) -> Side:
    """``python -m app +experiment=EXPERIMENT`` for ``args.steps`` env steps."""
    side = Side("ours", seed)
    before = os.getloadavg()[0]
    run = run_app(our_overrides(args, seed), out / f"ours_s{seed}", args.timeout)
    side.wall_s = round(run.wall_s, 2)
    side.load = (before, os.getloadavg()[0])
    if run.result is None:
        side.problem = run.problem
        return side
    side.env_steps = (run.result.get("summary") or {}).get("env_steps")
    side.episodes = curve_from_metrics(out / f"ours_s{seed}" / "metrics.csv",
                                       run.launch_to("first_update"))
    side.final_return = (run.result.get("summary") or {}).get("final_mean_return")
    return side


def curve_from_metrics(path: Path, first_update_s: float | None = None,
                       ) -> list[tuple[float, float, float]]:
    """(env steps, seconds since launch, mean return of the last ``loop.window`` episodes:
    ``return_window``) per update once an episode has ended, from our ``metrics.csv``. Its
    ``wall_s`` counts from the training loop's start; ``first_update_s`` (launch to the first
    update, from the run's timeline) moves it to count from launch, as CleanRL's does."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        return []
    shift = first_update_s - float(rows[0]["wall_s"]) if first_update_s is not None else 0.0
    points = []
    for row in rows:
        value = float(row["return_window"]) if row.get("return_window") else float("nan")
        if value == value:  # not NaN: an episode has ended
            points.append((float(row["env_steps"]), float(row["wall_s"]) + shift, value))
    return points


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(pairs: list[tuple[Side, Side]], last: int) -> list[str]:
    lines = [f"| seed | side | wall time, launch to exit | mean return, last {last} episodes | "
             "episodes | env steps/s | ours / CleanRL wall time | load before / after |",
             "|---|---|---|---|---|---|---|---|"]
    for cleanrl, ours in pairs:
        ratio = (ours.wall_s / cleanrl.wall_s
                 if ours.wall_s and cleanrl.wall_s and not (ours.problem or cleanrl.problem)
                 else None)
        for side in (cleanrl, ours):
            episodes = len(side.episodes) if side.name == "CleanRL" else "-"
            shown = _num(side.final_return, 1) + (f" ({side.problem[:100]})" if side.problem
                                                   else "")
            lines.append(
                f"| {side.seed} | {side.name} | {_num(side.wall_s, 1)} s | {shown} | {episodes} "
                f"| {_num(side.steps_per_s)} | {_num(ratio, 2) if side is ours else ''} | "
                f"{side.load[0]:.2f} / {side.load[1]:.2f} |")
    return lines


def plot(pairs: list[tuple[Side, Side]], last: int, path: Path) -> None:
    """Both sides' learning curves against env steps and against wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_steps, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for cleanrl, ours in pairs:
        smoothed = [(s, t, mean_last(cleanrl.episodes[: i + 1], last) or 0.0)
                    for i, (s, t, _) in enumerate(cleanrl.episodes)]
        for side, points, style in ((cleanrl, smoothed, "--"), (ours, ours.episodes, "-")):
            if points:
                label = f"{side.name} seed {side.seed}"
                by_steps.plot([p[0] for p in points], [p[2] for p in points], style, label=label)
                by_time.plot([p[1] for p in points], [p[2] for p in points], style, label=label)
    for axes, xlabel in ((by_steps, "env steps"), (by_time, "wall time (s)")):
        axes.set_xlabel(xlabel)
        axes.set_ylabel(f"mean return, last {last} episodes")
        axes.grid(alpha=0.3)
    by_steps.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cleanrl_sac",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cleanrl-script", type=Path, required=True, metavar="PATH",
                        help="cleanrl/sac_continuous_action.py in your CleanRL checkout")
    parser.add_argument("--cleanrl-python", default=sys.executable, metavar="PYTHON",
                        help="a Python with CleanRL's requirements (default: this one)")
    parser.add_argument("--steps", type=int, default=300_000, help="env steps per run")
    parser.add_argument("--seeds", default="1", help="comma-separated seeds (default: 1)")
    parser.add_argument("--experiment", default="hopper_sac", choices=sorted(CLEANRL_ENV))
    parser.add_argument("--env-id", help="CleanRL's --env-id (default: the experiment's "
                        "gymnasium 0.29 id, e.g. Hopper-v4)")
    parser.add_argument("--layout", help="our layout (default: the app's default, 2t2r)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="our loop.threads (default: the loop's, 1; CleanRL uses torch's "
                        "default, the machine's cores)")
    parser.add_argument("--learning-starts", type=int, metavar="L",
                        help="CleanRL's --learning-starts and our loop.replay.min_size")
    parser.add_argument("--last", type=int, default=20, help="episodes in the final mean")
    parser.add_argument("--timeout", type=float, default=3 * 3600.0,
                        help="seconds our run may take")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where the runs and results go "
                        "(default: outputs/bench/cleanrl-sac-<timestamp>)")
    args = parser.parse_args(argv)
    if not args.cleanrl_script.is_file():
        parser.error(f"--cleanrl-script: {args.cleanrl_script} is not a file")
    if args.steps <= 0:
        parser.error(f"--steps: must be positive, got {args.steps}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.env_id = args.env_id or CLEANRL_ENV[args.experiment]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = f"cleanrl-sac-{datetime.now():%Y-%m-%d_%H-%M-%S}"
    out = args.out or REPO_ROOT / "outputs" / "bench" / stamp
    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for seed in args.seeds:
        print(f"seed {seed}: CleanRL {args.env_id}, {args.steps:,} env steps ...", flush=True)
        cleanrl = run_cleanrl(args, seed, out)
        print(f"seed {seed}: ours +experiment={args.experiment} ...", flush=True)
        pairs.append((cleanrl, run_ours(args, seed, out)))
    lines = [*table(pairs, args.last), "",
             f"CleanRL: {args.cleanrl_script} --env-id {args.env_id}; ours: +experiment="
             f"{args.experiment}{' layout=' + args.layout if args.layout else ''}"
             f"{f' loop.threads={args.threads}' if args.threads is not None else ''}; "
             f"{args.steps:,} env steps each"]
    print("\n".join(lines))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    record: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                              "pairs": [[asdict(c), asdict(o)] for c, o in pairs]}
    (out / "results.json").write_text(json.dumps(record, indent=1))
    plot(pairs, args.last, out / "learning_curves.png")
    print(f"results: {out / 'results.md'}, {out / 'learning_curves.png'}")
    return 1 if any(c.problem or o.problem for c, o in pairs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
