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

What it shares with ``benchmarks.cleanrl_dqn`` (running CleanRL's script, reading its returns,
our run and its curve, the common options, the results and the picture) is in
``cleanrl_side.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import cleanrl_side
from .cleanrl_side import (
    QUIET,
    Side,
    curve_from_metrics,
    mean_last,
    num,
    parse_episodes,
    ratio,
    tensorboard_episodes,
)

# Read from here by name; the side, the returns and the curves live in cleanrl_side.py.
__all__ = ["Side", "curve_from_metrics", "main", "mean_last", "parse_args", "parse_episodes",
           "run_cleanrl", "run_ours", "table", "tensorboard_episodes"]

# Our experiment -> the id CleanRL's script runs under gymnasium 0.29 (which has no v5).
CLEANRL_ENV = {"hopper_sac": "Hopper-v4", "halfcheetah_sac": "HalfCheetah-v4"}
NAME = "cleanrl-sac"  # outputs/bench/NAME-<timestamp>/


def run_cleanrl(args: argparse.Namespace, seed: int, out: Path) -> Side:
    """CleanRL's script for ``args.steps`` env steps, timed from launch to exit."""
    side = Side("CleanRL", seed)
    options = ["--env-id", args.env_id, "--total-timesteps", str(args.steps), "--seed", str(seed),
               "--no-cuda", "--no-track", "--no-capture-video"]
    if args.learning_starts is not None:
        options += ["--learning-starts", str(args.learning_starts)]
    workdir = out / f"cleanrl_s{seed}"
    run = cleanrl_side.run_script(args.cleanrl_python, args.cleanrl_script, options, workdir)
    side.wall_s, side.load = run.wall_s, run.load
    side.episodes = run.episodes or tensorboard_episodes(workdir / "runs")
    side.final_return = mean_last(side.episodes, args.last)
    if run.returncode != 0:
        side.problem = f"exit code {run.returncode}: {run.tail()}"[:600]
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
    side, _ = cleanrl_side.run_ours("ours", seed, our_overrides(args, seed), out / f"ours_s{seed}",
                                    args.timeout)
    return side


def table(pairs: list[tuple[Side, Side]], last: int) -> list[str]:
    lines = [f"| seed | side | wall time, launch to exit | mean return, last {last} episodes | "
             "episodes | env steps/s | ours / CleanRL wall time | load before / after |",
             "|---|---|---|---|---|---|---|---|"]
    for cleanrl, ours in pairs:
        wall_ratio = (ratio(ours.wall_s, cleanrl.wall_s)
                      if not (ours.problem or cleanrl.problem) else None)
        for side in (cleanrl, ours):
            episodes = len(side.episodes) if side.name == "CleanRL" else "-"
            shown = num(side.final_return, 1) + (f" ({side.problem[:100]})" if side.problem
                                                 else "")
            lines.append(
                f"| {side.seed} | {side.name} | {num(side.wall_s, 1)} s | {shown} | {episodes} "
                f"| {num(side.steps_per_s)} | {num(wall_ratio, 2) if side is ours else ''} | "
                f"{side.load[0]:.2f} / {side.load[1]:.2f} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cleanrl_sac",
                                     description=__doc__.split("\n\n")[0])
    cleanrl_side.add_common_arguments(parser, NAME, "cleanrl/sac_continuous_action.py", seeds="1",
                                      layout="loop=sac's own, single")
    parser.add_argument("--steps", type=int, default=300_000, help="env steps per run")
    parser.add_argument("--experiment", default="hopper_sac", choices=sorted(CLEANRL_ENV))
    parser.add_argument("--env-id", help="CleanRL's --env-id (default: the experiment's "
                        "gymnasium 0.29 id, e.g. Hopper-v4)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="our loop.threads (default: the loop's, 1; CleanRL uses torch's "
                        "default, the machine's cores)")
    parser.add_argument("--learning-starts", type=int, metavar="L",
                        help="CleanRL's --learning-starts and our loop.replay.min_size")
    parser.add_argument("--last", type=int, default=20, help="episodes in the final mean")
    parser.add_argument("--timeout", type=float, default=3 * 3600.0,
                        help="seconds our run may take")
    args = parser.parse_args(argv)
    cleanrl_side.check_common_arguments(parser, args)
    if args.steps <= 0:
        parser.error(f"--steps: must be positive, got {args.steps}")
    args.env_id = args.env_id or CLEANRL_ENV[args.experiment]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = cleanrl_side.output_dir(args.out, NAME)
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
    cleanrl_side.write_results(out, lines, args, pairs)
    cleanrl_side.plot(pairs, args.last, out / "learning_curves.png")
    print(f"results: {out / 'results.md'}, {out / 'learning_curves.png'}")
    return 1 if any(c.problem or o.problem for c, o in pairs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
