"""What the side-by-side comparisons with CleanRL share (``benchmarks.cleanrl_sac``,
``benchmarks.cleanrl_dqn``): CleanRL's script run from a checkout with its output read as it
streams, its printed episodic returns, our side (``python -m app``) with its learning curve
counted from launch, the common options, and the results' table cells, files and picture.

An episode (or a point of our curve) is ``(env steps, seconds since launch, return)``; our
curve's return is already the mean of the run's last ``loop.window`` episodes.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .apprun import AppRun, run_app
from .procs import REPO_ROOT, users_environment

Episode = tuple[float, float, float]  # (env steps, seconds since launch, return)

EPISODE = re.compile(r"global_step=(\d+), episodic_return=\[?(-?[\d.eE+-]+)")
STOP_GRACE_S = 5.0  # a terminated script's time to exit before it is killed
# Our side runs its defaults but for the progress line, which CleanRL's scripts do not print.
# Its checkpoints stay on as a user gets them: since issue 59 one every 60 s of training, written
# in the background (before, one every 10 updates, all kept: DQN's seed 1 spent 35 s of its 92 s
# to 475 writing 285 of them, and the pairs ran with loop.checkpoint_every=0).
QUIET = ("loop.progress=false",)


@dataclass
class Side:
    """One run of one side: its time, its returns (env step, wall seconds, return) and why it
    has none."""

    name: str
    seed: int
    wall_s: float | None = None
    env_steps: int | None = None
    episodes: list[Episode] = field(default_factory=list)
    final_return: float | None = None  # mean of the last ``last`` episodes
    load: tuple[float, float] = (0.0, 0.0)
    problem: str = ""

    @property
    def steps_per_s(self) -> float | None:
        return self.env_steps / self.wall_s if self.env_steps and self.wall_s else None


def parse_episode(seconds: float, line: str) -> Episode | None:
    """CleanRL's ``global_step=G, episodic_return=[R]`` line, read ``seconds`` after launch, as
    (G, seconds, R); None for any other line."""
    match = EPISODE.search(line)
    if match is None:
        return None
    try:
        return float(match.group(1)), seconds, float(match.group(2))
    except ValueError:  # e.g. "1e+" cut short
        return None


def parse_episodes(lines: Sequence[tuple[float, str]]) -> list[Episode]:
    """CleanRL's ``global_step=G, episodic_return=[R]`` lines (with the seconds since launch
    each was read at) as (G, seconds, R)."""
    return [episode for seconds, line in lines
            if (episode := parse_episode(seconds, line)) is not None]


def tensorboard_episodes(directory: Path) -> list[Episode]:
    """``charts/episodic_return`` from the TensorBoard events under ``directory`` as (step,
    seconds since the first event, return); empty when there are none, or without this
    project's ``tensorboard`` extra to read them."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return []

    found: list[Episode] = []
    for events in sorted(directory.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "charts/episodic_return" not in accumulator.Tags().get("scalars", []):
            continue
        scalars = accumulator.Scalars("charts/episodic_return")
        start = scalars[0].wall_time if scalars else 0.0
        found += [(float(s.step), s.wall_time - start, float(s.value)) for s in scalars]
    return found


def mean_last(episodes: Sequence[Episode], last: int) -> float | None:
    """The mean return of the last ``last`` episodes (of fewer while there are fewer)."""
    recent = [r for _, _, r in episodes[-last:]]
    return sum(recent) / len(recent) if recent else None


def window_means(episodes: Sequence[Episode], last: int) -> list[Episode]:
    """Each episode with the mean of the last ``last`` returns up to it (fewer at first): the
    curve our runs record, from CleanRL's single returns."""
    return [(steps, seconds, mean_last(episodes[: i + 1], last) or 0.0)
            for i, (steps, seconds, _) in enumerate(episodes)]


@dataclass
class ScriptRun:
    """CleanRL's script run to its exit, or stopped: every line with the seconds since launch
    it was read at, and its episodes."""

    lines: list[tuple[float, str]]
    episodes: list[Episode]
    returncode: int
    wall_s: float  # launch to exit (of a stopped script too)
    load: tuple[float, float]  # the 1-minute load average before and after
    stopped_at: float | None = None  # seconds since launch when ``stop_when`` was met
    timed_out: bool = False  # stopped after ``max_seconds``

    def tail(self, count: int = 3) -> str:
        return " / ".join(line.strip() for _, line in self.lines[-count:])


def cleanrl_environment(script: Path) -> dict[str, str]:
    """A user's environment for CleanRL's ``script``: its checkout's root (where
    ``cleanrl_utils`` lives, beside ``cleanrl/``) on ``PYTHONPATH``, and unbuffered output, so
    that each line is read as it is printed."""
    env = users_environment()
    checkout = script.resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_script(python: str, script: Path, options: Sequence[str], workdir: Path,
               stop_when: Callable[[list[Episode]], bool] | None = None,
               max_seconds: float | None = None) -> ScriptRun:
    """``PYTHON SCRIPT OPTIONS`` in ``workdir`` (created; its output also goes to
    ``stdout.txt`` there), every line stamped with a monotonic clock from launch as it is read.
    Once ``stop_when(episodes so far)`` holds after a new episode, or after ``max_seconds``, the
    script and everything it started are terminated (killed ``STOP_GRACE_S`` later)."""
    workdir.mkdir(parents=True)
    argv = [python, str(script), *options]
    lines: list[tuple[float, str]] = []
    episodes: list[Episode] = []
    stopped_at: float | None = None
    timed_out = threading.Event()
    before = os.getloadavg()[0]
    started = time.monotonic()
    with (workdir / "stdout.txt").open("w") as log:
        proc = subprocess.Popen(argv, cwd=workdir, env=cleanrl_environment(script),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

        def terminate() -> None:
            for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
                with contextlib.suppress(ProcessLookupError):  # it may be gone already
                    os.killpg(proc.pid, sig)
                if grace is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(grace)
                        return

        def out_of_time() -> None:
            timed_out.set()
            terminate()

        timer = threading.Timer(max_seconds, out_of_time) if max_seconds else None
        if timer is not None:
            timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                seconds = time.monotonic() - started
                lines.append((seconds, line))
                log.write(line)
                episode = parse_episode(seconds, line)
                if episode is not None:
                    episodes.append(episode)
                    if stop_when is not None and stopped_at is None and stop_when(episodes):
                        stopped_at = seconds
                        terminate()
                        break
        finally:
            if timer is not None:
                timer.cancel()
            if proc.poll() is None and (stopped_at is not None or timed_out.is_set()):
                terminate()
            code = proc.wait()
    return ScriptRun(lines, episodes, code, round(time.monotonic() - started, 2),
                     (before, os.getloadavg()[0]), stopped_at, timed_out.is_set())


def curve_from_metrics(path: Path, first_update_s: float | None = None) -> list[Episode]:
    """(env steps, seconds since launch, mean return of the last ``loop.window`` episodes:
    ``return_window``) per update once an episode has ended, from our ``metrics.csv``. Its
    ``wall_s`` counts from the training loop's start; ``first_update_s`` (launch to the first
    update, from the run's timeline) moves it to count from launch, as CleanRL's does."""
    rows = metrics_rows(path)
    shift = loop_start_s(rows, first_update_s) or 0.0
    points = []
    for row in rows:
        value = float(row["return_window"]) if row.get("return_window") else float("nan")
        if value == value:  # not NaN: an episode has ended
            points.append((float(row["env_steps"]), float(row["wall_s"]) + shift, value))
    return points


def metrics_rows(path: Path) -> list[dict[str, str]]:
    """Our ``metrics.csv``'s rows (none without the file)."""
    if not path.exists():
        return []
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def loop_start_s(rows: list[dict[str, str]], first_update_s: float | None) -> float | None:
    """Launch to the zero of the training loop's clock (``metrics.csv``'s ``wall_s``, the
    summary's ``time_to_target_s``): launch to the first update less the loop's clock then."""
    if not rows or first_update_s is None:
        return None
    return first_update_s - float(rows[0]["wall_s"])


def run_ours(name: str, seed: int, overrides: Sequence[str], run_dir: Path, timeout: float,
             ) -> tuple[Side, AppRun]:
    """``python -m app OVERRIDES`` in ``run_dir``, timed from launch to exit: the side (its
    env steps, curve counted from launch, final mean return) and the run."""
    side = Side(name, seed)
    before = os.getloadavg()[0]
    run = run_app(overrides, run_dir, timeout)
    side.wall_s = round(run.wall_s, 2)
    side.load = (before, os.getloadavg()[0])
    if run.result is None:
        side.problem = run.problem
        return side, run
    summary = run.result.get("summary") or {}
    side.env_steps = summary.get("env_steps")
    side.episodes = curve_from_metrics(run_dir / "metrics.csv", run.launch_to("first_update"))
    side.final_return = summary.get("final_mean_return")
    return side, run


def num(value: float | None, digits: int = 0) -> str:
    """A table cell: ``-`` for no value, else with thousands separators."""
    return "-" if value is None else f"{value:,.{digits}f}"


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, when both are there (and theirs is not 0)."""
    return ours / theirs if ours is not None and theirs else None


def add_common_arguments(parser: argparse.ArgumentParser, name: str, script: str, seeds: str,
                         layout: str) -> None:
    """The options every CleanRL comparison has: ``name`` is its results' folder's prefix,
    ``script`` CleanRL's file."""
    parser.add_argument("--cleanrl-script", type=Path, required=True, metavar="PATH",
                        help=f"{script} in your CleanRL checkout")
    parser.add_argument("--cleanrl-python", default=sys.executable, metavar="PYTHON",
                        help="a Python with CleanRL's requirements (default: this one)")
    parser.add_argument("--seeds", default=seeds, help=f"comma-separated seeds (default: {seeds})")
    parser.add_argument("--layout", help=f"our layout (default: {layout})")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where the runs and results go "
                        f"(default: outputs/bench/{name}-<timestamp>)")


def check_common_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The script is a file; ``args.seeds`` becomes a list of ints (exits 2 otherwise)."""
    if not args.cleanrl_script.is_file():
        parser.error(f"--cleanrl-script: {args.cleanrl_script} is not a file")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    if not args.seeds:
        parser.error("--seeds: at least one seed")


def output_dir(out: Path | None, name: str) -> Path:
    """``out``, else ``outputs/bench/<name>-<timestamp>/``; created."""
    path = out or REPO_ROOT / "outputs" / "bench" / f"{name}-{datetime.now():%Y-%m-%d_%H-%M-%S}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_results(out: Path, lines: list[str], args: argparse.Namespace,
                  pairs: list[tuple[Any, Any]]) -> None:
    """``results.md`` (``lines``) and ``results.json`` (the options and every side of every
    pair, dataclasses as dicts) in ``out``."""
    (out / "results.md").write_text("\n".join(lines) + "\n")
    record: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                              "pairs": [[asdict(c), asdict(o)] for c, o in pairs]}
    (out / "results.json").write_text(json.dumps(record, indent=1))


def plot(pairs: Sequence[tuple[Side, Side]], last: int, path: Path, by_steps: bool = True,
         target: float | None = None) -> None:
    """Both sides' learning curves (CleanRL's returns as the mean of the last ``last``, ours as
    recorded) against wall time, and against env steps too with ``by_steps``; ``target`` as a
    horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2 if by_steps else 1, figsize=(12 if by_steps else 7, 4.5),
                                  squeeze=False)
    axes = list(panels[0])
    axis_of = {0: axes[0], 1: axes[-1]} if by_steps else {1: axes[0]}  # point index -> axes
    for number, (cleanrl, ours) in enumerate(pairs):  # a colour per seed, a style per side
        for side, points, style in ((cleanrl, window_means(cleanrl.episodes, last), "--"),
                                    (ours, ours.episodes, "-")):
            if points:
                label = f"{side.name} seed {side.seed}"
                for index, drawn in axis_of.items():
                    drawn.plot([p[index] for p in points], [p[2] for p in points], style,
                               color=f"C{number % 10}", label=label)
    for index, drawn in axis_of.items():
        drawn.set_xlabel("env steps" if index == 0 else "wall time since launch (s)")
        drawn.set_ylabel(f"mean return, last {last} episodes")
        drawn.grid(alpha=0.3)
        if target is not None:
            drawn.axhline(target, color="grey", linewidth=0.8, linestyle=":")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
