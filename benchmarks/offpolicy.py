"""Off-policy throughput: ``python -m benchmarks.offpolicy [--quick] [--only sac,dqn]``.

SAC on MuJoCo Hopper-v5 (``+experiment=hopper_sac``) and DQN on CartPole-v1 (``loop=dqn``), each
on five layouts, one collector or two (docs/benchmarks.md, "Off-policy throughput"):

- ``single``: one rank collects and learns (one collector, colocated with its replay shard);
- ``1t1r``: one learner with its replay shard, one collector rank;
- ``1t2r``: one learner with its replay shard, two collector ranks writing to it (Ape-X's many
  writers and one reader, ``layout=1t1r layout.world_size=3 layout.rollouts=[1,2]``);
- ``2t2r``: the default layout, two DDP learners with a shard each, a collector rank per learner;
- ``replay_server``: one learner sampling from a replay on its own rank, which two collector
  ranks write to (Ape-X's replay server, ``layout.replay``).

Per run it prints, from the run's ``metrics.csv`` and ``result.json``:

- env steps/s and learner steps/s while learning (from the first update with a learner step
  to the end: the warm-up to ``loop.replay.min_size`` has no learner and is left out), and env
  steps/s over the whole run;
- the samples-per-insert ratio held and the updates in which the limiter held the learner back;
- the time split of every rank's loop (``time_split_s``), as shares per role: collecting (env
  steps, the policy's forward, packing), replay (inserting, sampling and writing priorities:
  the update's ``replay_s`` in ``metrics.csv``), learning (the rest of the update: the
  learner's steps), communication (segments, weights, episodes), waiting (blocked on the other
  side of the hand-off: part of communication, shown on its own) and other (records,
  checkpoints);
- the load average before and after.

Each run keeps its run dir under ``outputs/bench/offpolicy-<timestamp>/``, with ``results.json``
(every figure) and ``results.md`` (the table, for ``benchmarks/results/<date>.md``). Run it
alone on the machine: every other process on the cores shows in the rates. ``--quick`` is a
smoke of every run at a tiny budget (about 2 minutes on 2 cores), not a measurement.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .apprun import run_app
from .procs import REPO_ROOT

LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {  # name -> (collector ranks, overrides)
    "single": (1, ("layout=single",)),
    "1t1r": (1, ("layout=1t1r",)),
    "1t2r": (2, ("layout=1t2r",)),
    "2t2r": (2, ("layout=2t2r",)),
    "replay_server": (2, ("layout=replay_server",)),
}
QUIET = ("loop.progress=false", "loop.checkpoint_every=0", "loop.stop_at_target=false")
# algorithm -> (overrides, full budget overrides, quick budget overrides)
ALGORITHMS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    # CleanRL's SAC on Hopper: 5,000 uniform random steps, then 10,000 env steps of learning at
    # one batch of 256 per env step (the rates are the learning phase's).
    "sac": (("+experiment=hopper_sac",), ("loop.total_env_steps=15000",),
            ("loop.total_env_steps=1536", "loop.replay.min_size=512",
             "loop.replay.capacity=10000")),
    # loop=dqn's defaults on CartPole-v1, trained on to the budget past the target.
    "dqn": (("loop=dqn",), ("loop.total_env_steps=60000",),
            ("loop.total_env_steps=4096", "loop.replay.min_size=1024")),
}
RUN_TIMEOUT_S = {"quick": 240.0, "full": 1200.0}
# The split's columns: name -> the time_split_s parts summed (waiting comes from wait_fraction).
COLUMNS = {"collect": ("env", "act", "collect_other"), "update": ("update",),
           "comm": ("comm",), "other": ("other",)}
SPLIT_NAMES = ("collect", "replay", "learn", "comm", "waiting", "other")  # the table's order
ROLES = ("trainer+rollout", "trainer", "replay", "rollout")


@dataclass
class Measured:
    """One run's figures, or why it has none."""

    algorithm: str
    layout: str
    collectors: int
    wall_s: float | None = None  # launch to exit
    env_steps: int | None = None
    env_steps_per_s: float | None = None  # over the whole run
    learning_env_steps_per_s: float | None = None
    learner_steps_per_s: float | None = None  # per learner (DDP steps on 2 trainers)
    samples_per_insert: float | None = None
    learner_wait_updates: int | None = None
    split: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> column -> share
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before and after
    problem: str = ""


def learning_rates(rows: list[dict[str, float]]) -> tuple[float, float] | None:
    """Env steps/s and learner steps/s from the update before the first learner step to the
    last update (``metrics.csv``'s ``env_steps``, ``wall_s`` and ``learner_steps``); None when
    the learner never stepped."""
    first = next((i for i, row in enumerate(rows) if row.get("learner_steps", 0) > 0), None)
    if first is None:
        return None
    start = rows[first - 1] if first > 0 else {"env_steps": 0.0, "wall_s": 0.0}
    end = rows[-1]
    seconds = end["wall_s"] - start["wall_s"]
    if seconds <= 0:
        return None
    learner_steps = sum(row["learner_steps"] for row in rows[first:])
    return (end["env_steps"] - start["env_steps"]) / seconds, learner_steps / seconds


def split_shares(result: dict[str, Any], in_replay: float = 0.0) -> dict[str, dict[str, float]]:
    """Per role, the median over its ranks of each column's share of the rank's loop time;
    waiting (``wait_fraction``) is taken out of communication and shown on its own, and the
    update is split into replay (its share ``in_replay``) and learning."""
    per_role: dict[str, list[dict[str, float]]] = {}
    for rank in result.get("ranks", []):
        own = rank.get("result") or {}
        parts = own.get("time_split_s")
        if not parts or not parts.get("loop"):
            continue
        loop = float(parts["loop"])
        shares = {name: sum(float(parts.get(p, 0.0)) for p in keys) / loop
                  for name, keys in COLUMNS.items()}
        waiting = min(float(own.get("wait_fraction", 0.0)), shares["comm"])
        shares["comm"] -= waiting
        shares["waiting"] = waiting
        update = shares.pop("update")
        shares["replay"], shares["learn"] = update * in_replay, update * (1 - in_replay)
        per_role.setdefault(str(own.get("role", rank.get("role", "?"))), []).append(shares)
    return {role: {name: statistics.median(s[name] for s in found) for name in found[0]}
            for role, found in per_role.items()}


def replay_fraction(result: dict[str, Any], rows: list[dict[str, float]]) -> float:
    """The share of the update spent in the replay: ``metrics.csv``'s ``replay_s`` (averaged
    over the trainers) summed over the run, over rank 0's update seconds."""
    ranks = result.get("ranks") or [{}]
    update = float(((ranks[0].get("result") or {}).get("time_split_s") or {}).get("update", 0))
    in_replay = sum(row["replay_s"] for row in rows
                    if row.get("replay_s") is not None and row["replay_s"] == row["replay_s"])
    return min(max(in_replay / update, 0.0), 1.0) if update > 0 else 0.0


def read_metrics(path: Path) -> list[dict[str, float]]:
    with path.open(newline="") as handle:
        return [{k: float(v) if v not in ("", None) else float("nan") for k, v in row.items()}
                for row in csv.DictReader(handle)]


def measure(algorithm: str, layout: str, quick: bool, seed: int, out: Path) -> Measured:
    """One ``python -m app`` run of ``algorithm`` on ``layout``, read back."""
    collectors, layout_overrides = LAYOUTS[layout]
    base, full, tiny = ALGORITHMS[algorithm]
    overrides = (*base, *layout_overrides, *(tiny if quick else full), *QUIET, f"seed={seed}")
    measured = Measured(algorithm, layout, collectors)
    before = os.getloadavg()[0]
    run = run_app(overrides, out / f"{algorithm}_{layout}",
                  RUN_TIMEOUT_S["quick" if quick else "full"])
    measured.load = (before, os.getloadavg()[0])
    measured.wall_s = round(run.wall_s, 2)
    if run.result is None:
        measured.problem = run.problem
        return measured
    fill(measured, run.result, read_metrics(out / f"{algorithm}_{layout}" / "metrics.csv"))
    return measured


def fill(measured: Measured, result: dict[str, Any], rows: list[dict[str, float]]) -> None:
    """``measured``'s figures from a finished run's ``result.json`` and ``metrics.csv``."""
    summary = result.get("summary") or {}
    measured.env_steps = summary.get("env_steps")
    measured.env_steps_per_s = summary.get("env_steps_per_s")
    replay = summary.get("replay") or {}
    measured.samples_per_insert = replay.get("samples_per_insert")
    measured.learner_wait_updates = replay.get("learner_wait_updates")
    rates = learning_rates(rows)
    if rates is None:
        measured.problem = "the learner never stepped (budget below loop.replay.min_size?)"
    else:
        measured.learning_env_steps_per_s = round(rates[0], 1)
        measured.learner_steps_per_s = round(rates[1], 1)
    measured.split = split_shares(result, replay_fraction(result, rows))


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(found: list[Measured]) -> list[str]:
    """The Markdown table: one line per run and role (the split is per role)."""
    split_names = SPLIT_NAMES
    lines = [
        "| algorithm | layout | collectors | env steps/s learning | learner steps/s | env steps/s "
        "whole run | samples/insert | learner waited | role | "
        + " | ".join(split_names) + " | load before / after |",
        "|---" * (10 + len(split_names)) + "|",
    ]
    for m in found:
        head = (f"| {m.algorithm} | {m.layout} | {m.collectors} | "
                f"{_num(m.learning_env_steps_per_s)} | {_num(m.learner_steps_per_s)} | "
                f"{_num(m.env_steps_per_s)} | {_num(m.samples_per_insert, 2)} | "
                f"{_num(m.learner_wait_updates)} | ")
        load = f" {m.load[0]:.2f} / {m.load[1]:.2f} |"
        if m.problem and not m.split:
            lines.append(head + f"failed: {m.problem[:120]} |" + " |" * len(split_names) + load)
            continue
        for role in [*[r for r in ROLES if r in m.split], *sorted(set(m.split) - set(ROLES))]:
            shares = " | ".join(f"{100 * m.split[role][name]:.0f}%" for name in split_names)
            lines.append(head + f"{role} | {shares} |" + load)
            head = "| | | | | | | | | "  # one run's figures once, its roles below
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offpolicy",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke of every run at a tiny budget, not a measurement")
    parser.add_argument("--only", default="sac,dqn", metavar="ALGO[,ALGO]",
                        help=f"among {', '.join(ALGORITHMS)} (default: both)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), metavar="NAME[,NAME]",
                        help=f"among {', '.join(LAYOUTS)} (default: all)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where the runs and results go "
                        "(default: outputs/bench/offpolicy-<timestamp>)")
    args = parser.parse_args(argv)
    args.only = [a.strip() for a in args.only.split(",") if a.strip()]
    args.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    for given, known, flag in ((args.only, ALGORITHMS, "--only"),
                               (args.layouts, LAYOUTS, "--layouts")):
        unknown = sorted(set(given) - set(known))
        if unknown or not given:
            parser.error(f"{flag}: unknown or empty {unknown}; known: {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = f"offpolicy-{datetime.now():%Y-%m-%d_%H-%M-%S}"
    out = args.out or REPO_ROOT / "outputs" / "bench" / stamp
    out.mkdir(parents=True, exist_ok=True)
    start_load = os.getloadavg()
    found: list[Measured] = []
    for algorithm in args.only:
        for layout in args.layouts:
            print(f"{algorithm} on {layout} ...", flush=True)
            found.append(measure(algorithm, layout, args.quick, args.seed, out))
    end_load = os.getloadavg()
    loads = (f"load average {' / '.join(f'{v:.2f}' for v in start_load)} at the start, "
             f"{' / '.join(f'{v:.2f}' for v in end_load)} at the end")
    lines = [*table(found), "", loads + ("; --quick: a smoke, not a measurement" if args.quick
                                         else "")]
    print("\n".join(lines))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(
        {"quick": args.quick, "seed": args.seed, "load_start": start_load, "load_end": end_load,
         "runs": [asdict(m) for m in found]}, indent=1))
    print(f"results: {out / 'results.md'}")
    return 1 if any(m.problem for m in found) else 0


if __name__ == "__main__":
    raise SystemExit(main())
