"""DQN against CleanRL's on the same machine, time to return 475 on CartPole-v1:
``python -m benchmarks.cleanrl_dqn --cleanrl-script PATH --cleanrl-python PYTHON
[--seeds S[,S]] [--layout NAME] [--max-seconds N]``.

CleanRL is not part of this repository. Pass ``--cleanrl-script``, the path of
``cleanrl/dqn.py`` in your checkout of CleanRL (it imports ``cleanrl_utils`` from the checkout's
root, which this benchmark puts on its ``PYTHONPATH``), and ``--cleanrl-python``, a Python with
CleanRL's own requirements (gymnasium 0.29.1, numpy 1.26, stable-baselines3 2.3.2, tyro,
tensorboard, torch): under gymnasium 1.x the script prints no episodic returns (it reads 0.29's
``final_info``). For example::

    git clone https://github.com/vwxyzjn/cleanrl ~/cleanrl
    python -m venv --system-site-packages ~/cleanrl-venv    # torch from this environment
    ~/cleanrl-venv/bin/pip install gymnasium==0.29.1 numpy==1.26.4 stable-baselines3==2.3.2 \\
        tyro tensorboard

For each seed, back to back and alone on the machine, it runs:

1. CleanRL: ``PYTHON dqn.py --env-id CartPole-v1 --seed S --no-cuda --no-track
   --no-capture-video`` (its defaults otherwise: 500,000 env steps, no stop at a target), in
   its own directory under the benchmark's. Each ``global_step=G, episodic_return=[R]`` line is
   stamped as it is printed, with a monotonic clock from launch; its time to the target is the
   first moment the mean of its last 20 returns reaches 475, its env steps then ``G``. It is
   terminated there (it would train on to its budget), or after ``--max-seconds`` (300);
2. ours: ``python -m app loop=dqn seed=S`` (loop=dqn's own layout, single, unless ``--layout``),
   which stops by itself once the mean return of its last 20 episodes reaches 475 (CartPole-v1's
   reward threshold, ``loop.target_return``'s default). Its wall time is launch to exit; its
   time to the target is the run's ``time_to_target_s`` (``result.json``'s summary, counted from
   the training loop's start) moved to count from launch as CleanRL's does (the launch to the
   first update, from the run's timeline, less ``metrics.csv``'s first ``wall_s``), its env
   steps ``env_steps_to_target``.

It prints, per seed and side: the time to return 475 from launch (and ours from the training
loop's start), the env steps then, the wall time from launch to exit, the ratio of the times to
475 (ours / CleanRL) and the 1-minute load average before and after each run. Everything goes
to ``outputs/bench/cleanrl-dqn-<timestamp>/`` (or ``--out``): ``results.json``, ``results.md``
(the table) and ``learning_curves.png`` (the mean return of the last 20 episodes against the
wall time since launch, both sides, one line per seed).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import cleanrl_side
from .cleanrl_side import QUIET, Episode, Side, num, ratio

NAME = "cleanrl-dqn"  # outputs/bench/NAME-<timestamp>/
ENV_ID = "CartPole-v1"
TARGET, WINDOW = 475.0, 20  # CartPole-v1's reward threshold; the app's loop.window
MAX_SECONDS = 300.0


@dataclass
class TargetSide(Side):
    """A side timed to the target: seconds from launch and env steps when the mean of its last
    ``WINDOW`` returns first reached ``TARGET``."""

    target_s: float | None = None  # from launch
    target_steps: int | None = None
    loop_target_s: float | None = None  # ours: the run's own figure, from the loop's start
    stopped: str = ""  # CleanRL: that it was terminated at the target, before its budget


def first_reach(episodes: list[Episode], target: float, window: int) -> Episode | None:
    """The first episode at which the mean of the last ``window`` returns (a full window, as
    our stop rule) is at least ``target``, as (env steps, seconds since launch, that mean);
    None if there is none."""
    for end in range(window, len(episodes) + 1):
        recent = episodes[end - window: end]
        if reached(recent, target, window):
            steps, seconds, _ = recent[-1]
            return steps, seconds, sum(value for _, _, value in recent) / window
    return None


def reached(episodes: list[Episode], target: float = TARGET, window: int = WINDOW) -> bool:
    """Whether the last ``window`` returns (a full window) average ``target`` or more: checked
    after each of CleanRL's episodes as they stream."""
    recent = [value for _, _, value in episodes[-window:]]
    return len(recent) == window and sum(recent) / window >= target


def cleanrl_options(seed: int) -> list[str]:
    """CleanRL's dqn.py's command line: the env, the seed, CPU only and nothing recorded."""
    return ["--env-id", ENV_ID, "--seed", str(seed), "--no-cuda", "--no-track",
            "--no-capture-video"]


def run_cleanrl(args: argparse.Namespace, seed: int, out: Path) -> TargetSide:
    """CleanRL's dqn.py from launch until the mean of its last 20 returns reaches 475 (then it
    is terminated), its budget ends or ``args.max_seconds`` pass."""
    side = TargetSide("CleanRL", seed)
    run = cleanrl_side.run_script(args.cleanrl_python, args.cleanrl_script,
                                  cleanrl_options(seed), out / f"cleanrl_s{seed}",
                                  stop_when=reached, max_seconds=args.max_seconds)
    side.wall_s, side.load, side.episodes = run.wall_s, run.load, run.episodes
    side.final_return = cleanrl_side.mean_last(side.episodes, WINDOW)
    hit = first_reach(side.episodes, TARGET, WINDOW)
    if hit is not None:
        side.target_steps, side.target_s = int(hit[0]), round(hit[1], 2)
        side.env_steps = side.target_steps
        if run.stopped_at is not None:  # else it ended by itself at that line
            side.stopped = f"terminated at the target, {run.stopped_at:.2f} s after launch"
        return side
    if not side.episodes:
        side.problem = ("it printed no episodic returns: run it with CleanRL's own requirements "
                        "(gymnasium 0.29), --cleanrl-python")
    elif run.timed_out:
        side.problem = (f"the mean of its last {WINDOW} returns did not reach {TARGET:g} "
                        f"within {args.max_seconds:g} s (--max-seconds): "
                        f"{num(side.final_return, 1)} at {num(side.episodes[-1][0])} env steps")
    else:
        side.problem = (f"it ended (exit code {run.returncode}) before the mean reached "
                        f"{TARGET:g}: {run.tail()}")
    side.problem = side.problem[:600]
    return side


def our_overrides(args: argparse.Namespace, seed: int) -> list[str]:
    """Our side's command line: ``loop=dqn seed=S`` without what CleanRL does not do
    (``cleanrl_side.QUIET``), and the layout only when given."""
    return ["loop=dqn", f"seed={seed}", *QUIET,
            *([f"layout={args.layout}"] if args.layout else [])]


def our_target(summary: dict[str, Any], loop_start_s: float | None,
               ) -> tuple[float | None, float | None, int | None]:
    """(seconds from launch, seconds from the loop's start, env steps) to the target, from our
    summary and the launch to the loop clock's zero; Nones for a run that did not reach it."""
    in_loop = summary.get("time_to_target_s")
    steps = summary.get("env_steps_to_target")
    if in_loop is None:
        return None, None, None
    from_launch = round(in_loop + loop_start_s, 2) if loop_start_s is not None else None
    return from_launch, float(in_loop), int(steps) if steps is not None else None


def run_ours(args: argparse.Namespace, seed: int, out: Path,
             extra: Sequence[str] = ()) -> TargetSide:
    """``python -m app loop=dqn seed=S`` (and ``extra`` overrides), launch to exit, with its
    time to the target."""
    run_dir = out / f"ours_s{seed}"
    plain, run = cleanrl_side.run_ours("ours", seed, [*our_overrides(args, seed), *extra],
                                       run_dir, args.timeout)
    side = TargetSide(**vars(plain))
    if run.result is None:
        return side
    summary = run.result.get("summary") or {}
    start = cleanrl_side.loop_start_s(cleanrl_side.metrics_rows(run_dir / "metrics.csv"),
                                      run.launch_to("first_update"))
    side.target_s, side.loop_target_s, side.target_steps = our_target(summary, start)
    if side.loop_target_s is None:
        side.problem = (f"did not reach {summary.get('target_return', TARGET)} in "
                        f"{summary.get('env_steps') or 0:,} env steps (final mean "
                        f"{num(summary.get('final_mean_return'), 1)})")
    elif side.target_s is None:
        side.problem = "no timeline or metrics.csv to count its time to the target from launch"
    return side


def table(pairs: list[tuple[TargetSide, TargetSide]]) -> list[str]:
    """The Markdown table: one row per side and seed."""
    lines = [f"| seed | side | time to {TARGET:g}, from launch | env steps to {TARGET:g} | "
             "wall time, launch to exit | ours / CleanRL time to target | load before / after "
             "| notes |",
             "|---|---|---|---|---|---|---|---|"]
    for cleanrl, ours in pairs:
        time_ratio = ratio(ours.target_s, cleanrl.target_s)
        for side in (cleanrl, ours):
            to_target = f"{num(side.target_s, 1)} s" if side.target_s is not None else "-"
            if side.loop_target_s is not None:
                to_target += f" ({side.loop_target_s:.1f} s in training)"
            notes = "; ".join(n for n in (side.stopped, side.problem[:200]) if n)
            lines.append(
                f"| {side.seed} | {side.name} | {to_target} | {num(side.target_steps)} | "
                f"{num(side.wall_s, 1)} s | {num(time_ratio, 2) if side is ours else ''} | "
                f"{side.load[0]:.2f} / {side.load[1]:.2f} | {notes} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cleanrl_dqn",
                                     description=__doc__.split("\n\n")[0])
    cleanrl_side.add_common_arguments(parser, NAME, "cleanrl/dqn.py", seeds="1,2,3",
                                      layout="loop=dqn's own, single")
    parser.add_argument("--max-seconds", type=float, default=MAX_SECONDS, metavar="N",
                        help="CleanRL is terminated after N seconds if it has not reached the "
                        f"target (default: {MAX_SECONDS:g})")
    parser.add_argument("--timeout", type=float, default=1800.0, metavar="N",
                        help="seconds our run may take (default: 1800)")
    args = parser.parse_args(argv)
    cleanrl_side.check_common_arguments(parser, args)
    if args.max_seconds <= 0 or args.timeout <= 0:
        parser.error("--max-seconds and --timeout: must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = cleanrl_side.output_dir(args.out, NAME)
    pairs = []
    for seed in args.seeds:
        print(f"seed {seed}: CleanRL dqn.py {ENV_ID}, to a mean of {TARGET:g} over {WINDOW} "
              f"returns (at most {args.max_seconds:g} s) ...", flush=True)
        cleanrl = run_cleanrl(args, seed, out)
        print(f"seed {seed}: CleanRL: {num(cleanrl.target_s, 1)} s, "
              f"{num(cleanrl.target_steps)} env steps to {TARGET:g}"
              f"{'; ' + cleanrl.stopped if cleanrl.stopped else ''}"
              f"{'; ' + cleanrl.problem if cleanrl.problem else ''}", flush=True)
        print(f"seed {seed}: ours {' '.join(our_overrides(args, seed))} ...", flush=True)
        ours = run_ours(args, seed, out)
        print(f"seed {seed}: ours: {num(ours.target_s, 1)} s, {num(ours.target_steps)} env "
              f"steps to {TARGET:g}, {num(ours.wall_s, 1)} s launch to exit"
              f"{'; ' + ours.problem if ours.problem else ''}", flush=True)
        pairs.append((cleanrl, ours))
    lines = [*table(pairs), "",
             f"CleanRL: {args.cleanrl_script} --env-id {ENV_ID}, its defaults "
             f"otherwise, terminated once the mean of its last {WINDOW} returns reached "
             f"{TARGET:g}; ours: python -m app loop=dqn"
             f"{' layout=' + args.layout if args.layout else ''}, stopped by itself there"]
    print("\n".join(lines))
    cleanrl_side.write_results(out, lines, args, pairs)
    cleanrl_side.plot(pairs, WINDOW, out / "learning_curves.png", by_steps=False, target=TARGET)
    print(f"results: {out / 'results.md'}, {out / 'learning_curves.png'}")
    return 1 if any(c.problem or o.problem for c, o in pairs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
