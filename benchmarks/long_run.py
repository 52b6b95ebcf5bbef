"""Long runs: what a run costs as it goes on (issue 59; docs/data-safety.md, "What grows with a
run").

Each run is the documented command on its defaults (``python -m app``, ``loop=dqn``,
``loop=sac``) told to train on past its target (``loop.stop_at_target=false`` and a budget it
never reaches), watched from outside for ``minutes`` and then stopped with SIGTERM (which
ends it with a last checkpoint). This process samples every ``SAMPLE_S`` seconds:

- every rank's RSS (the processes named ``rlcomm-rank<N>``): the growth per hour after the
  first ``WARMUP_S`` seconds (a least-squares slope), as a share of the rank's RSS, and
  extrapolated to a week;
- the run dir's size on disk, and the checkpoints kept;

and reads from the run's own records:

- each checkpoint's size, the update loop's time taking its snapshot and waiting for the
  previous write, and the background write's time (rank 0's log, app/runtime/checkpoints/
  checkpointer.py), against the update it was taken at;
- env steps/s in the first minute and in the last one (metrics.csv).

Then, ``loop=dqn`` to a mean-20 return of 475 on seeds 1-3 with the defaults against
``loop.checkpoint_every=0`` (no checkpoints at all), back to back: wall time from launch to
exit, per seed.

Goals: checkpoint size flat (the last within 10% of the first); env steps/s in the last minute
within 5% of the first minute's (on the default run); the update loop's wait per checkpoint
under 10 ms at PPO's default model; RSS growth under 1% per hour; the default DQN run within
1.05x of no checkpoints. Run it alone and give the load average with every figure.

``python -m benchmarks --only long_run`` (60 minutes of PPO, 20 each of DQN and SAC) or
``python -m benchmarks.long_run [--ppo-minutes M] [--offpolicy-minutes M] [--seeds 1,2,3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from app.launch.environment import without_launcher_variables

from .core import BYTES, NUMBER, PER_SECOND, SECONDS, Goal, Row, Settings, Stat
from .procs import REPO_ROOT

NAME = "long_run"
SAMPLE_S = 10.0
WARMUP_S = 120.0
HOURS_PER_WEEK = 168
FOREVER = ("loop.stop_at_target=false", f"loop.total_env_steps={10**12}")
RUNS = {
    "PPO (default)": (),
    "DQN (loop=dqn)": ("loop=dqn",),
    "SAC (loop=sac)": ("loop=sac",),
}
_COST = re.compile(r"checkpoint ckpt_(\d+)(?:\.pt)?: (\d+) bytes; the update loop took ([\d.]+) "
                   r"ms for its snapshot and waited ([\d.]+) ms for the previous write; written "
                   r"in ([\d.]+) ms")


@dataclass
class Watched:
    """What one long run showed."""

    name: str
    run_dir: Path
    seconds: float = 0.0
    # (seconds since launch, rank -> RSS bytes)
    rss: list[tuple[float, dict[int, int]]] = field(default_factory=list)
    disk: list[tuple[float, int]] = field(default_factory=list)
    # update -> (bytes, snapshot ms, waited ms, write ms)
    checkpoints: dict[int, tuple[int, float, float, float]] = field(default_factory=dict)
    rates: tuple[float, float] | None = None  # env steps/s: the first minute, the last one
    exit_code: int | None = None
    load: str = ""


def _ranks(launcher: int) -> dict[int, psutil.Process]:
    found: dict[int, psutil.Process] = {}
    try:
        children = psutil.Process(launcher).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for proc in children:
        try:
            match = re.fullmatch(r"rlcomm-rank(\d+)", proc.name())
            if match:
                found[int(match.group(1))] = proc
        except psutil.Error:
            continue
    return found


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def watch(name: str, overrides: tuple[str, ...], minutes: float, out: Path) -> Watched:
    """One run of ``python -m app *overrides``, watched for ``minutes``, then SIGTERMed."""
    run_dir = out / re.sub(r"\W+", "_", name).strip("_").lower()
    argv = [sys.executable, "-m", "app", *overrides, *FOREVER, "loop.progress=false",
            f"hydra.run.dir={run_dir}"]
    seen = Watched(name, run_dir)
    started = time.monotonic()
    with (out / f"{run_dir.name}.out").open("w") as log:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=without_launcher_variables(os.environ))
        try:
            while time.monotonic() - started < 60 * minutes and proc.poll() is None:
                time.sleep(SAMPLE_S)
                now = time.monotonic() - started
                rss: dict[int, int] = {}
                for rank, process in _ranks(proc.pid).items():
                    try:
                        rss[rank] = process.memory_info().rss
                    except psutil.Error:
                        continue
                seen.rss.append((now, rss))
                seen.disk.append((now, _du(run_dir)))
            seen.load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the last checkpoint, then the end
            seen.exit_code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    seen.seconds = time.monotonic() - started
    seen.checkpoints = checkpoint_costs(run_dir / "logs" / "rank0.log")
    seen.rates = first_and_last_minute(run_dir / "metrics.csv")
    return seen


def checkpoint_costs(log: Path) -> dict[int, tuple[int, float, float, float]]:
    """Each checkpoint's (bytes, snapshot ms, waited ms, write ms) by update, from a rank log."""
    found: dict[int, tuple[int, float, float, float]] = {}
    if log.exists():
        for match in _COST.finditer(log.read_text(errors="replace")):
            update, size, took, waited, wrote = match.groups()
            found[int(update)] = (int(size), float(took), float(waited), float(wrote))
    return found


def first_and_last_minute(metrics: Path) -> tuple[float, float] | None:
    """Env steps/s over the first minute of training and over the last one (metrics.csv's
    ``wall_s`` and ``env_steps``), or None for a run shorter than two minutes."""
    import csv

    if not metrics.exists():
        return None
    with metrics.open() as handle:
        points = [(float(r["wall_s"]), float(r["env_steps"])) for r in csv.DictReader(handle)]
    if not points or points[-1][0] < 120:
        return None

    def rate(start: float, end: float) -> float:
        inside = [p for p in points if start <= p[0] <= end]
        (t0, s0), (t1, s1) = inside[0], inside[-1]
        return (s1 - s0) / (t1 - t0)

    return rate(0.0, 60.0), rate(points[-1][0] - 60.0, points[-1][0])


def rss_growth(samples: list[tuple[float, dict[int, int]]]) -> dict[int, tuple[float, float]]:
    """Each rank's RSS growth after the warm-up: (% of its mean RSS per hour, MB per week)."""
    growth: dict[int, tuple[float, float]] = {}
    ranks = sorted({rank for _, rss in samples for rank in rss})
    for rank in ranks:
        points = [(t, rss[rank]) for t, rss in samples if rank in rss and t >= WARMUP_S]
        if len(points) < 3:
            continue
        slope = statistics.linear_regression([t for t, _ in points],
                                             [float(v) for _, v in points]).slope  # bytes/s
        mean = statistics.fmean(v for _, v in points)
        growth[rank] = (100 * slope * 3600 / mean, slope * 3600 * HOURS_PER_WEEK / 1e6)
    return growth


def rows_of(seen: Watched, ppo: bool) -> list[Row]:
    """The rows one watched run gives."""
    rows: list[Row] = []
    note = f"{seen.seconds / 60:.0f} min, load {seen.load}, exit {seen.exit_code}"
    costs = [seen.checkpoints[u] for u in sorted(seen.checkpoints)]
    if costs:
        first, last = costs[0][0], costs[-1][0]
        rows.append(Row(NAME, f"{seen.name}: checkpoint size, last / first ({len(costs)} "
                        "checkpoints)", unit=NUMBER, ratio=Stat.single(last / first),
                        rlcomm=Stat.single(last), reference=Stat.single(first),
                        reference_name="first checkpoint", goal=Goal("<=", 1.10), note=note,
                        extra={"checkpoints": {u: list(c) for u, c in seen.checkpoints.items()}}))
        waits = [took + waited for _, took, waited, _ in costs]
        rows.append(Row(NAME, f"{seen.name}: update loop's wait per checkpoint (snapshot + "
                        "previous write)", unit=SECONDS, rlcomm=Stat.of([w / 1e3 for w in waits]),
                        goal=Goal("<", 0.010, on="max") if ppo else None, note=note))
        rows.append(Row(NAME, f"{seen.name}: background write per checkpoint", unit=SECONDS,
                        rlcomm=Stat.of([c[3] / 1e3 for c in costs]), note=note))
    growth = rss_growth(seen.rss)
    if growth:
        worst = max(growth, key=lambda r: growth[r][0])
        rows.append(Row(NAME, f"{seen.name}: RSS growth per hour after warm-up, worst rank "
                        f"({worst})", unit="%/h", rlcomm=Stat.single(growth[worst][0]),
                        goal=Goal("<", 1.0, on="value"), note=note,
                        extra={"per_rank_pct_per_h_and_mb_per_week": growth}))
    if seen.rates is not None and ppo:
        first_rate, last_rate = seen.rates
        rows.append(Row(NAME, f"{seen.name}: env steps/s, last minute / first minute",
                        unit=PER_SECOND, rlcomm=Stat.single(last_rate),
                        reference=Stat.single(first_rate), reference_name="first minute",
                        ratio=Stat.single(last_rate / first_rate), goal=Goal(">=", 0.95),
                        note=note))
    if seen.disk:
        rows.append(Row(NAME, f"{seen.name}: run dir on disk at the end", unit=BYTES,
                        rlcomm=Stat.single(seen.disk[-1][1]), note=note))
    return rows


def dqn_cadence_cost(seeds: list[int], out: Path) -> Row:
    """``loop=dqn`` to its target, defaults against ``loop.checkpoint_every=0``, per seed."""
    times: dict[str, list[float | None]] = {"defaults": [], "none": []}
    for seed in seeds:
        for label, extra in (("defaults", ()), ("none", ("loop.checkpoint_every=0",))):
            run_dir = out / f"dqn_seed{seed}_{label}"
            tick = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "app", "loop=dqn", f"seed={seed}", *extra,
                 "loop.progress=false", f"hydra.run.dir={run_dir}"], cwd=REPO_ROOT,
                env=without_launcher_variables(os.environ), capture_output=True, check=False)
            solved = done.returncode == 0 and json.loads(
                (run_dir / "result.json").read_text())["summary"]["solved"]
            times[label].append(time.perf_counter() - tick if solved else None)
    row = Row(NAME, "loop=dqn to 475, seeds " + ",".join(map(str, seeds)) + ": defaults / "
              "loop.checkpoint_every=0 (launch to exit)", unit=SECONDS, goal=Goal("<=", 1.05),
              reference_name="no checkpoints",
              note=f"load {' / '.join(f'{x:.1f}' for x in os.getloadavg())}",
              extra={"per_seed_s": times})
    row.set_per_seed(times["defaults"], times["none"])
    return row


def measure(ppo_minutes: float, offpolicy_minutes: float, seeds: list[int],
            out: Path) -> list[Row]:
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for name, overrides in RUNS.items():
        ppo = name.startswith("PPO")
        seen = watch(name, overrides, ppo_minutes if ppo else offpolicy_minutes, out)
        rows += rows_of(seen, ppo)
        print(f"{name}: done ({seen.seconds / 60:.1f} min)", flush=True)
    if seeds:
        rows.append(dqn_cadence_cost(seeds, out))
    return rows


def run(settings: Settings) -> list[Row]:
    minutes = (3.0, 2.0) if settings.quick else (60.0, 20.0)
    return measure(*minutes, seeds=[1] if settings.quick else [1, 2, 3],
                   out=settings.out_dir / NAME)


def main(argv: list[str] | None = None) -> int:
    from .report import table, write

    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ppo-minutes", type=float, default=60.0)
    parser.add_argument("--offpolicy-minutes", type=float, default=20.0)
    parser.add_argument("--seeds", default="1,2,3", help="DQN's seeds ('' for none)")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out = REPO_ROOT / "outputs" / "bench" / stamp
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = measure(args.ppo_minutes, args.offpolicy_minutes, seeds, out / NAME)
    meta: dict[str, Any] = {"timestamp": stamp, "load_average_at_start": load,
                            "load_average_at_end": " / ".join(
                                f"{x:.1f}" for x in os.getloadavg()),
                            "sections": [NAME]}
    write(rows, meta, out)
    print(table(rows))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
