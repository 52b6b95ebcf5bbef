"""A job that grows while it runs (``python -m benchmarks --only growth``): the default run on the
waiting CartPole, ``python -m app loop.env.id=WaitingCartPole-v1`` (2t2r, 2 ms a step, as a
remote simulator's), grown by ``python -m app.join RUN_DIR role=rollout`` from 2 rollout ranks
to 3, 4 and 6 (two joiners at once for the last), then stopped (SIGTERM: a checkpoint).

Rows:

- env steps/s with 2, 3, 4 and 6 rollout ranks, each over the updates after the joiners were
  admitted (goal: 6 at least 2.5x 2);
- from each joiner's own start (its imports done: ``run_beyond_plan``) to its first segment
  trained on (goal: every one within 2 s), and from ``python -m app.join`` to it (reported);
- updates lost while the job grew (goal: none): gaps in the trainers' update count, restarts;
- what growth does to learning: the same command to its target (return 475), as it is and
  grown at its third update by one trainer (``role=trainer``) and two rollout ranks (2t2r to
  3t4r), over seeds 0 and 1 (0 alone with ``--quick``): the env steps and seconds each took
  (reported), and the learning curves in ``<bench dir>/growth/learning.png``.

The run dirs are under ``<bench dir>/growth/``; each joiner's output is beside them.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .apprun import run_app
from .core import NUMBER, PER_SECOND, SECONDS, Goal, Row, Settings, Stat, ratios
from .procs import REPO_ROOT, users_environment

NAME = "growth"
COMMAND = ("loop.env.id=WaitingCartPole-v1",)  # the documented one (docs/environments.md)
# A long run: neither its budget nor its target ends it (CartPole is solved on the way); the
# benchmark stops it (SIGTERM) once it measured it all.
LONG = ("loop.total_env_steps=100000000", "loop.stop_at_target=false", "loop.progress=false")
STEPS = (3, 4, 6)  # rollout ranks after each round of joins
SETTLE = 1  # updates after a change left out of its rate (the joiner's first, partial one)
MEASURE = {"full": 8, "quick": 4}  # updates each rate is taken over
TIMEOUT_S = 600.0
SEEDS = {"full": (0, 1), "quick": (0,)}  # the learning comparison's
STATIC, GROWN = "2t2r throughout", "grown from 2t2r to 3t4r at update 3"


def run(settings: Settings) -> list[Row]:
    base = settings.out_dir / NAME
    base.mkdir(parents=True, exist_ok=True)
    run_dir = base / "run"
    measured = MEASURE["quick" if settings.quick else "full"]
    argv = [sys.executable, "-m", "app", *COMMAND, *LONG, f"hydra.run.dir={run_dir}"]
    with (base / "run.stdout").open("w") as out, (base / "run.stderr").open("w") as err:
        app = subprocess.Popen(argv, cwd=REPO_ROOT, env=users_environment(), stdout=out,
                               stderr=err, start_new_session=True)
    joiners: list[tuple[subprocess.Popen[bytes], float]] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        _wait(run_dir, lambda rows: len(rows) >= SETTLE + measured, deadline, app)
        for target in STEPS:
            have = _members(_rows(run_dir))
            for _ in range(target - have):
                joiners.append(_join(run_dir, base / f"joiner{len(joiners)}.out"))
            _wait(run_dir, lambda rows, t=target: _members(rows) == t, deadline, app)
            changed = len(_rows(run_dir))
            _wait(run_dir, lambda rows, c=changed: len(rows) >= c + SETTLE + measured,
                  deadline, app)
        os.kill(app.pid, signal.SIGTERM)  # a stop with a checkpoint: the joiners end with it
        app.wait(timeout=120)
    finally:
        _end([app, *(j for j, _ in joiners)])
    result = json.loads((run_dir / "result.json").read_text())
    rows = _rows_of(_rows(run_dir), result, [started for _, started in joiners], measured)
    return rows + _learning(base, SEEDS["quick" if settings.quick else "full"])


def _learning(base: Path, seeds: tuple[int, ...]) -> list[Row]:
    """The command to its target as it is, and grown at its third update by one trainer and
    two rollout ranks (2t2r to 3t4r: the first rollout joiner goes to the new trainer), per
    seed, run one after another."""
    curves: dict[str, dict[int, list[dict[str, str]]]] = {STATIC: {}, GROWN: {}}
    for seed in seeds:
        static = base / f"static-seed{seed}"
        run_app([*COMMAND, f"seed={seed}"], static, TIMEOUT_S)
        curves[STATIC][seed] = _rows(static)
        curves[GROWN][seed] = _grown_run(base, seed)
    _plot(curves, base / "learning.png")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    out = []
    for what, column, unit in (("env steps", "env_steps", NUMBER), ("seconds", "wall_s", SECONDS)):
        solved = {name: [_solved_at(rows, column) for rows in by_seed.values()]
                  for name, by_seed in curves.items()}
        ours, theirs = ([x for x in solved[name] if x] for name in (GROWN, STATIC))
        both = all(solved[GROWN]) and all(solved[STATIC])
        out.append(Row(NAME, f"{what} to return 475, {GROWN}", unit,
                       Stat.of(ours) if ours else None, Stat.of(theirs) if theirs else None,
                       ratios(ours, theirs) if both else None, reference_name=STATIC,
                       note=f"seeds {list(seeds)}, reported; learning.png; load {load}",
                       status="ok" if both else "failed"))
    return out


def _grown_run(base: Path, seed: int) -> list[dict[str, str]]:
    """One run of the command grown at its third update; its metrics rows."""
    grown = base / f"grown-seed{seed}"
    with (base / f"{grown.name}.stdout").open("w") as sink, \
            (base / f"{grown.name}.stderr").open("w") as err:
        app = subprocess.Popen([sys.executable, "-m", "app", *COMMAND, f"seed={seed}",
                                f"hydra.run.dir={grown}"], cwd=REPO_ROOT,
                               env=users_environment(), stdout=sink, stderr=err,
                               start_new_session=True)
    joiners: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        _wait(grown, lambda rows: len(rows) >= 3, deadline, app)
        joiners.append(_join(grown, base / f"{grown.name}-trainer.out", "trainer")[0])
        _wait(grown, lambda rows: _trainers(rows) == 3, deadline, app)
        joiners += [_join(grown, base / f"{grown.name}-joiner{i}.out")[0] for i in range(2)]
        app.wait(timeout=TIMEOUT_S)
    finally:
        _end([app, *joiners])
    return _rows(grown)


def _solved_at(rows: list[dict[str, str]], column: str) -> float | None:
    """Where the mean of the last window first reached 475 (CartPole's target)."""
    return next((float(r[column]) for r in rows if r["return_window"] not in ("", "nan")
                 and float(r["return_window"]) >= 475), None)


def _plot(curves: dict[str, dict[int, list[dict[str, str]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, by_seed), color in zip(curves.items(), ("tab:blue", "tab:orange")):
        for seed, rows in by_seed.items():
            kept = [r for r in rows if r["return_window"] not in ("", "nan")]
            ax.plot([float(r["env_steps"]) for r in kept],
                    [float(r["return_window"]) for r in kept], color=color,
                    label=f"{name}, seed {seed}", linestyle="-" if seed == min(by_seed) else "--")
    ax.set_xlabel("env steps")
    ax.set_ylabel("mean return of the last window")
    ax.set_title("PPO on WaitingCartPole-v1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _join(run_dir: Path, out: Path,
          role: str = "rollout") -> tuple[subprocess.Popen[bytes], float]:
    with out.open("w") as sink:
        started = time.time()
        joiner = subprocess.Popen([sys.executable, "-m", "app.join", str(run_dir), f"role={role}"],
                                  cwd=REPO_ROOT, env=users_environment(), stdout=sink,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    return joiner, started


def _rows(run_dir: Path) -> list[dict[str, str]]:
    try:
        with (run_dir / "metrics.csv").open() as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


def _members(rows: list[dict[str, str]]) -> int:
    return int(float(rows[-1]["members"])) if rows else 0


def _trainers(rows: list[dict[str, str]]) -> int:
    return int(float(rows[-1]["trainers"])) if rows else 0


def _wait(run_dir: Path, done: Any, deadline: float, app: subprocess.Popen[bytes]) -> None:
    while not done(_rows(run_dir)):
        if app.poll() is not None:
            raise RuntimeError(f"the run ended (exit {app.returncode}) before the benchmark did")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done within {TIMEOUT_S:.0f} s")
        time.sleep(0.2)


def _end(procs: list[subprocess.Popen[bytes]]) -> None:
    """Whatever is still running after the stop is killed with its session."""
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _rate(rows: list[dict[str, str]], members: int, measured: int) -> float | None:
    """Env steps/s over ``measured`` updates with ``members`` rollout ranks, after ``SETTLE``."""
    picked = [r for r in rows if int(float(r["members"])) == members][SETTLE:]
    picked = picked[: measured + 1]
    if len(picked) < 2:
        return None
    steps = float(picked[-1]["env_steps"]) - float(picked[0]["env_steps"])
    return steps / (float(picked[-1]["wall_s"]) - float(picked[0]["wall_s"]))


def _rows_of(rows: list[dict[str, str]], result: dict[str, Any], starts: list[float],
             measured: int) -> list[Row]:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    rates = {m: _rate(rows, m, measured) for m in (2, *STEPS)}
    out = []
    for members, rate in rates.items():
        row = Row(NAME, f"env steps/s with {members} rollout ranks", PER_SECOND,
                  Stat.single(rate) if rate else None, status="ok" if rate else "failed",
                  note=f"over {measured} updates; load {load}")
        if members == STEPS[-1] and rate and rates[2]:
            row.reference, row.reference_name = Stat.single(rates[2]), "2 rollout ranks"
            row.ratio, row.goal = Stat.single(rate / rates[2]), Goal(">=", 2.5)
        out.append(row)
    joins = sorted(result.get("joins", []), key=lambda j: j["rank"])
    marks = result.get("timeline", {}).get("ranks", {})
    trained = [j["time"] + j["first_trained_s"] for j in joins if j.get("first_trained_s")]
    own = [t - marks[str(j["rank"])]["started"] for j, t in zip(joins, trained, strict=False)
           if "started" in marks.get(str(j["rank"]), {})]
    admitted = [j["time"] - marks[str(j["rank"])]["started"] for j in joins
                if "started" in marks.get(str(j["rank"]), {})]
    split = (f"of which start to admission (the next update boundary) median "
             f"{Stat.of(admitted).median:.2f} s, the rest its first segment's collection and "
             "the update that trains it; " if admitted else "")
    out.append(Row(NAME, "joiner's start (imports done) to its first segment trained on",
                   SECONDS, Stat.of(own) if own else None, goal=Goal("<=", 2.0, on="max"),
                   status="ok" if own else "failed",
                   note=f"{len(own)} joiners; {split}load {load}"))
    command = [t - s for t, s in zip(trained, starts, strict=False)]
    out.append(Row(NAME, "python -m app.join to its first segment trained on", SECONDS,
                   Stat.of(command) if command else None, status="ok" if command else "failed",
                   note=f"reported: its imports and probe included; load {load}"))
    updates = [int(float(r["update"])) for r in rows]
    lost = (updates[-1] - updates[0] + 1 - len(updates)) if updates else 0
    restarts = result.get("summary", {}).get("restarts", 0) or 0
    out.append(Row(NAME, "updates lost while the job grew", NUMBER,
                   Stat.single(float(lost + restarts)), goal=Goal("<=", 0.0, on="value"),
                   note=f"{len(updates)} updates, {restarts} restarts"))
    return out
