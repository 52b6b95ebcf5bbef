"""A trainer lost mid-run: elastic trainers against the restart path, side by side.

For each env (CartPole on the default 2t2r, Hopper with ``+experiment=hopper`` on 2t2r,
uncompiled: the experiment's own 1t2r has one trainer), two runs back to back, each with trainer
rank 1 (the process named ``rlcomm-rank1``) SIGKILLed ``KILL_AFTER_S`` seconds after its first
update:

- **elastic**: ``launcher.trainer_restarts=1`` (the survivors go on; a new process heals from
  the lead trainer and rejoins);
- **restart**: ``layout.elastic_trainers=false launcher.max_restarts=1`` (every rank restarts
  from the newest checkpoint).

This process watches metrics.csv and notes when each row appeared, so both paths are timed on
one clock whatever the run's own attempts count. From those times and the run's records:

- env steps/s in the ``WINDOW_S`` seconds before the kill, and in the ``WINDOW_S`` seconds after it;
- from the kill to the next update (a row of a new update);
- from the kill to the heal (elastic: the trainer's join in result.json; restart: the first new
  update of the restarted ranks);
- env steps/s in the ``WINDOW_S`` seconds after the heal, as a share of the rate before the kill;
- the updates computed twice (elastic: none, the update in flight goes on over the survivors;
  restart: from the checkpoint it resumed from to the last update before the kill);
- the learning curves of both paths and of an uninterrupted run of the same settings, on one
  plot per env (``<out>/trainer_loss/<env>_learning_curves.png``).

Goals (issue 47): the next update within 2 s of the kill, no update computed twice but the one
in flight, and the rate after the heal back at >= 0.9x the rate before. Run it alone, and give the
load average with every figure.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.launch.environment import without_launcher_variables

from .core import NUMBER, PER_SECOND, SECONDS, Goal, Row, Settings, Stat
from .procs import REPO_ROOT, kill_rank

NAME = "trainer_loss"
KILL_AFTER_S = 40.0
WINDOW_S = 30.0
RUN_S = KILL_AFTER_S + 3 * WINDOW_S  # how long a run trains (its step budget, from its rate)
ENVS = {
    "CartPole": ("loop.target_return=1e9", "loop.progress=false"),
    # Two trainers to lose one of (the experiment's own layout, 1t2r, has one), as measured.
    "Hopper": ("+experiment=hopper", "layout=2t2r", "loop.compile=off", "loop.target_return=1e9",
               "loop.progress=false"),
}
PATHS = {
    "elastic": ("launcher.trainer_restarts=1",),
    "restart": ("layout.elastic_trainers=false", "launcher.max_restarts=1"),
    "uninterrupted": (),  # the learning curve's reference: no kill
}
RATE = {"CartPole": 25_000, "Hopper": 4_500}  # env steps/s here, roughly: the step budget


@dataclass
class Watched:
    """One run: when each update's row appeared, its env steps, and the kill."""

    # update -> (time its row appeared, env steps, the stop rule's mean return)
    rows: dict[int, tuple[float, int, float]] = field(default_factory=dict)
    killed_at: float | None = None
    # The restart path: the newest update the first attempt wrote (the restarted one rewrites
    # metrics.csv from its checkpoint's rows: the file shrinks), as soon as that was seen.
    first_attempt_last: int | None = None
    log0: str = ""
    result: dict[str, Any] | None = None


def _watch(argv: list[str], run_dir: Path, kill: bool) -> Watched:
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=without_launcher_variables(os.environ),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    watched, metrics = Watched(), run_dir / "metrics.csv"
    first: float | None = None
    seen = 0
    deadline = time.monotonic() + RUN_S * 4 + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            now = time.time()
            written = _rows(metrics)
            if len(written) < seen and watched.first_attempt_last is None:
                watched.first_attempt_last = max(watched.rows)
            seen = len(written)
            for row in written:  # a restart's redone updates keep their first time
                watched.rows.setdefault(int(float(row["update"])), (
                    now, int(float(row["env_steps"])), float(row["return_window"] or "nan")))
            if watched.rows and first is None:
                first = now
            if kill and first is not None and watched.killed_at is None and \
                    now - first > KILL_AFTER_S:
                watched.killed_at = kill_rank(proc.pid, 1)
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log = run_dir / "logs" / "rank0.log"
    watched.log0 = log.read_text() if log.exists() else ""
    result = run_dir / "result.json"
    if result.exists():
        watched.result = json.loads(result.read_text())
    return watched


def _rows(metrics: Path) -> list[dict[str, str]]:
    if not metrics.exists():
        return []
    with metrics.open() as handle:
        return [row for row in csv.DictReader(handle) if row.get("env_steps")]


def _rate(watched: Watched, start: float, end: float) -> float | None:
    """Env steps/s between ``start`` and ``end`` (the job's counter, as rows appeared)."""
    inside = sorted((t, s) for t, s, _ in watched.rows.values() if start <= t <= end)
    if len(inside) < 2:
        return None
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 else None


def _measures(path: str, watched: Watched) -> dict[str, float | None]:
    kill = watched.killed_at
    assert kill is not None
    before = _rate(watched, kill - WINDOW_S, kill)
    last_before = max((u for u, (t, _, _) in watched.rows.items() if t <= kill), default=0)
    # The restart path's next update is its restarted attempt's first new one (the dying
    # attempt may still write an update or two before the agent stops it).
    done = watched.first_attempt_last if watched.first_attempt_last is not None else last_before
    after_rows = sorted(t for u, (t, _, _) in watched.rows.items() if t > kill and u > done)
    next_update = after_rows[0] - kill if after_rows else None
    twice: float | None
    if path == "elastic":
        joins = (watched.result or {}).get("trainer_joins") or []
        heal = joins[0]["time"] - kill if joins else None
        twice = 0.0  # the update in flight goes on over the survivors (trainers/gradients.py)
    else:
        heal = next_update
        resumed = re.findall(r"resumed from \S+ at update (\d+)", watched.log0)
        twice = float(done - int(resumed[-1])) if resumed else None
    healed_at = kill + heal if heal is not None else None
    return {
        "rate before": before,
        "rate after kill": _rate(watched, kill, kill + WINDOW_S),
        "kill -> next update": next_update,
        "kill -> healed": heal,
        "rate after heal / before": (
            (_rate(watched, healed_at, healed_at + WINDOW_S) or 0.0) / before
            if healed_at is not None and before else None),
        "updates computed twice": twice,
    }


UNITS = {"rate before": PER_SECOND, "rate after kill": PER_SECOND,
         "kill -> next update": SECONDS, "kill -> healed": SECONDS,
         "rate after heal / before": NUMBER, "updates computed twice": NUMBER}
GOALS = {"kill -> next update": Goal("<=", 2.0, on="value"),
         "rate after heal / before": Goal(">=", 0.9, on="value"),
         "updates computed twice": Goal("<=", 0.0, on="value")}


def plot(runs: dict[str, Watched], env: str, path: Path) -> None:
    """The stop rule's mean return against env steps, one line per path, the kill marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for name, watched in sorted(runs.items(), key=lambda run: run[0] == "elastic"):  # on top
        points = sorted((s, r) for _, s, r in watched.rows.values())
        axes.plot([s for s, _ in points], [r for _, r in points], label=name)
        if watched.killed_at is not None:
            before = [s for t, s, _ in watched.rows.values() if t <= watched.killed_at]
            if before:
                axes.axvline(max(before), linestyle=":", color=axes.lines[-1].get_color())
    axes.set_xlabel("env steps")
    axes.set_ylabel("mean return (the stop rule's window)")
    axes.set_title(f"{env}: trainer rank 1 SIGKILLed (dotted), against no loss")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run(settings: Settings) -> list[Row]:
    rows: list[Row] = []
    for env, overrides in ENVS.items():
        budget = int(RATE[env] * RUN_S)
        found: dict[str, dict[str, float | None]] = {}
        runs: dict[str, Watched] = {}
        for path, flags in PATHS.items():
            run_dir = settings.out_dir / NAME / f"{env}_{path}"
            argv = [sys.executable, "-m", "app", *overrides, *flags,
                    f"loop.total_env_steps={budget}", f"hydra.run.dir={run_dir}"]
            watched = runs[path] = _watch(argv, run_dir, kill=path != "uninterrupted")
            if watched.killed_at is not None and watched.rows:
                found[path] = _measures(path, watched)
        plot(runs, env, settings.out_dir / NAME / f"{env}_learning_curves.png")
        for measure, unit in UNITS.items():
            row = Row(NAME, f"{env}: {measure}", unit=unit, reference_name="restart path",
                      goal=GOALS.get(measure))
            mine = found.get("elastic", {}).get(measure)
            theirs = found.get("restart", {}).get(measure)
            if mine is None:
                row.status = "failed"
            else:
                row.rlcomm = Stat.single(mine)
            if theirs is not None:
                row.reference = Stat.single(theirs)
            row.note = (f"trainer rank 1 SIGKILLed {KILL_AFTER_S:g} s after the first update; "
                        f"windows of {WINDOW_S:g} s; elastic: launcher.trainer_restarts=1")
            rows.append(row)
    return rows
