"""The Ray engine against the local launcher (``python -m benchmarks --only ray``): the same
documented commands, ``python -m app`` and ``python -m app +experiment=hopper``, on their
defaults and with ``launcher.engine=ray`` (a local Ray started for the run, as a user without
a cluster gets it), one run of each in alternating order, on the same machine.

Per command (median [min..max] over the pairs):

- launch to exit (goal: Ray within 1.15x of local);
- env steps/s of the training loop (goal: Ray at least 1/1.15 of local);
- the start-up split: under Ray, validation to Ray up (``ray.init``, a local Ray's own start),
  to the ranks placed (placement groups), to the last rank running its code (actors, each
  rank's own Python and imports); under local, validation to the last rank running (the
  forkserver's forks). Where Ray's own start-up is the difference, the note says how much.

The Hopper pair runs 1M env steps each (4-6 minutes a run on 2 cores), so this section runs
only when named. Beside them, a variant: the default run on a Ray already running on this
machine (``ray start --head``, ``launcher.ray.address=auto``), as a Ray cluster's user gets it,
reported only. Each run keeps its run dir under ``<bench dir>/ray/``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
from pathlib import Path

from .apprun import AppRun, run_app
from .core import PER_SECOND, SECONDS, Goal, Row, Settings, Stat, ratios

NAME = "ray"
RAY = ("launcher.engine=ray",)
COMMANDS = {"default": (), "hopper": ("+experiment=hopper",)}  # name -> the documented command
PAIRS = {"default": {"full": 3, "quick": 1}, "hopper": {"full": 1, "quick": 0}}
TIMEOUT_S = {"default": 300.0, "hopper": 1800.0}
GOAL = 1.15


def run(settings: Settings) -> list[Row]:
    base = settings.out_dir / NAME
    rows: list[Row] = []
    for command, overrides in COMMANDS.items():
        pairs = PAIRS[command]["quick" if settings.quick else "full"]
        if not pairs:
            rows.append(Row(NAME, f"{command}: launch to exit", status="skipped",
                            note="not part of --quick"))
            continue
        local: list[AppRun] = []
        on_ray: list[AppRun] = []
        for i in range(pairs):
            order = [("local", ()), ("ray", RAY)] if i % 2 == 0 else [("ray", RAY), ("local", ())]
            for engine, extra in order:
                done = run_app([*overrides, *extra], base / f"{command}-{engine}-{i}",
                               TIMEOUT_S[command])
                (on_ray if engine == "ray" else local).append(done)
        rows += rows_of(command, local, on_ray)
    rows.append(existing_ray_row(base, PAIRS["default"]["quick" if settings.quick else "full"]))
    return rows


def existing_ray_row(base: Path, runs: int) -> Row:
    """A variant beside the default: the default run on a Ray already up on this machine
    (``ray start --head``, then ``launcher.ray.address=auto``), as on a Ray cluster, where
    neither Ray's start nor its stop is the run's."""
    started = subprocess.run(["ray", "start", "--head", f"--num-cpus={max(4, os.cpu_count() or 1)}",
                              "--include-dashboard=false"], capture_output=True, text=True,
                             check=False, timeout=120)
    name = "default on a running Ray (address=auto): launch to exit"
    if started.returncode != 0:
        return Row(NAME, name, status="failed", note=started.stderr[-400:])
    try:
        done = [run_app([*RAY, "launcher.ray.address=auto"], base / f"default-auto-{i}",
                        TIMEOUT_S["default"]) for i in range(runs)]
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, check=False, timeout=120)
    walls = [r.wall_s for r in done if r.result is not None]
    problems = "; ".join(r.problem for r in done if r.problem)
    return Row(NAME, name, SECONDS, Stat.of(walls) if walls else None,
               note=f"variant, reported only; load {_load()}" + (f"; {problems}" if problems else ""),
               status="ok" if walls else "failed")


def rows_of(command: str, local: list[AppRun], on_ray: list[AppRun]) -> list[Row]:
    problems = [f"{r.argv[-1]}: {r.problem}" for r in [*local, *on_ray] if r.problem]
    pairs = [(a, b) for a, b in zip(local, on_ray, strict=True)
             if a.result is not None and b.result is not None]
    if not pairs:
        return [Row(NAME, f"{command}: launch to exit", status="failed",
                    note="; ".join(problems)[:600])]
    walls = ([b.wall_s for _, b in pairs], [a.wall_s for a, _ in pairs])
    rates = ([_rate(b) for _, b in pairs], [_rate(a) for a, _ in pairs])
    note = f"load {_load()}; {startup_note(pairs)}"
    if problems:
        note += "; left out: " + "; ".join(problems)[:400]
    return [
        Row(NAME, f"{command}: launch to exit", SECONDS, Stat.of(walls[0]), Stat.of(walls[1]),
            ratios(*walls), Goal("<=", GOAL), "local launcher, same command", note),
        Row(NAME, f"{command}: env steps/s", PER_SECOND, Stat.of(rates[0]), Stat.of(rates[1]),
            ratios(*rates), Goal(">=", round(1 / GOAL, 3)), "local launcher, same command"),
        Row(NAME, f"{command}: Ray's own start (ray.init)", SECONDS,
            Stat.of([_between(b, "validated", "ray_connected") for _, b in pairs]),
            note="reported only: validation to a local Ray up"),
    ]


def startup_note(pairs: list[tuple[AppRun, AppRun]]) -> str:
    """The start-up split, medians: where Ray's start-up goes, and the local launcher's."""
    def median(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    ray_up = median([_between(b, "validated", "ray_connected") for _, b in pairs])
    placed = median([_between(b, "ray_connected", "placed") for _, b in pairs])
    ranks_up = median([_between(b, "placed", None) for _, b in pairs])
    local_up = median([_between(a, "validated", None) for a, _ in pairs])
    return (f"start-up, Ray: {ray_up:.2f} s to Ray up, {placed:.2f} s to placed, "
            f"{ranks_up:.2f} s to every rank running; local: {local_up:.2f} s to every rank "
            "running")


def _between(run: AppRun, first: str, last: str | None) -> float:
    """Seconds from launcher mark ``first`` to ``last`` (None: the last rank's ``started``)."""
    marks = run.timeline
    ranks = marks.get("ranks") or {}
    end = (max(r["started"] for r in ranks.values() if "started" in r) if last is None
           else marks[last])
    return float(end - marks[first])


def _rate(run: AppRun) -> float:
    assert run.result is not None
    return float(run.result["metrics"]["env_steps_per_s"])


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())

