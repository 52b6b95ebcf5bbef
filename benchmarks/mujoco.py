"""MuJoCo continuous control against CleanRL's published results: ``python -m app
+experiment=hopper`` (PPO on Hopper-v5, 1M env steps, conf/experiment/hopper.yaml) on the
experiment's own layout and compile setting (``layout=1t2r loop.compile=inductor``: one trainer,
two rollout ranks, the update compiled; until 2026-12-06 the app's 2t2r, uncompiled) and on
``layout=single`` (one rank, the same compile setting), ``SEEDS`` each, one run of each per seed
in alternating order. See docs/mujoco.md.

Per layout, over the seeds (median [min..max]):

- the return at 1M env steps (the mean of the last 20 episodes when the budget ends the run)
  against CleanRL's published ``ppo_continuous_action.py`` return on Hopper-v4 (goal: median
  >= 2,300);
- the wall time, launch to exit, against CleanRL's script on this machine (1,175 env steps/s,
  measured 2026-12-02 over its first 61,440 steps, projected to 1M: 851 s; goal: ratio <= 0.5);
- env steps/s of the training loop, updates included (goal: >= 1,500);
- the measured time split (``time_split_s`` in each rank's result): the share of all ranks'
  loop time spent stepping envs, in the policy's forward, in the update and communicating
  (waiting on other ranks included); the note splits it per role.

Learning curves (return against env steps and against wall time, one line per seed, CleanRL's
published final band shaded) go to ``<bench dir>/mujoco/hopper_learning_curves.png``; each run
keeps its run dir (``result.json``, ``metrics.csv``) under ``<bench dir>/mujoco/``.

Six runs of 4-6 minutes each on an idle 2-core machine (29.5 minutes in all on 2026-12-02; more
under load): this section does not fit the shared 10-minute budget and ignores it (``python -m
benchmarks --only mujoco``; it is not part of ``--quick``). A run that fails or runs past
``RUN_TIMEOUT_S`` leaves its values out (noted in the rows).

``python -m benchmarks.mujoco SWEEP_DIR`` prints the layout sweep's table with its reasons (see
:func:`sweep_table`).
"""

from __future__ import annotations

import csv
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .apprun import AppRun, run_app
from .core import NUMBER, PER_SECOND, SECONDS, Goal, Row, Settings, Stat, ratios

NAME = "mujoco"
EXPERIMENT = "hopper"  # conf/experiment/hopper.yaml
ENV_ID = "Hopper-v5"
SEEDS = (0, 1, 2)
RUNS = {"default": (), "single": ("layout=single",)}  # name -> overrides
BUDGET = 1_000_000  # env steps (the experiment's own total_env_steps)
RUN_TIMEOUT_S = 1800.0
# CleanRL's ppo_continuous_action.py, published (docs/benchmark/ppo.md, Hopper-v4, 1M steps,
# 1 env): mean and standard deviation over its seeds.
CLEANRL_RETURN, CLEANRL_STD = 2382.86, 271.74
# CleanRL's script as published, run on this machine on 2026-12-02: 1,175 env steps/s over its
# first 61,440 steps (Hopper-v4, seed 1, gymnasium 0.29.1, mujoco 2.3.7, torch 2.13.0 CPU); its
# time to 1M env steps is projected from that rate. (On 2026-12-01's machine: 752 env steps/s.)
CLEANRL_STEPS_PER_S, CLEANRL_MEASURED_ON = 1175.0, "2026-12-02"
CLEANRL_WALL_S = BUDGET / CLEANRL_STEPS_PER_S
RETURN_GOAL = Goal(">=", 2300.0, on="value")
WALL_GOAL = Goal("<=", 0.5)
RATE_GOAL = Goal(">=", 1500.0, on="value")
# time_split_s part -> what the row calls it
SPLIT = {"env": "env stepping", "act": "policy forward", "update": "update",
         "comm": "communication"}
ROLES = ("trainer+rollout", "trainer", "rollout")


@dataclass
class Outcome:
    """One run: its figures, learning curve and time split, or why it has none."""

    run: AppRun | None = None
    final_return: float | None = None
    steps_per_s: float | None = None
    curve: list[tuple[float, float, float]] = field(default_factory=list)  # steps, s, return
    split: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> part -> seconds
    load: tuple[str, str] = ("", "")  # load averages at start and end
    problem: str = ""


def overrides(kind: str, seed: int) -> list[str]:
    """The app's command line for one run (``hydra.run.dir`` aside)."""
    return [f"+experiment={EXPERIMENT}", *RUNS[kind], f"seed={seed}",
            f"loop.total_env_steps={BUDGET}", "loop.progress=false"]


def run_one(kind: str, seed: int, run_dir: Path, timeout: float) -> Outcome:
    load_before = _load()
    app = run_app(overrides(kind, seed), run_dir, timeout)
    outcome = Outcome(app, load=(load_before, _load()))
    if app.result is None:
        outcome.problem = f"{kind} seed {seed}: {app.problem}"
        return outcome
    return read_outcome(outcome, app.result, run_dir)


def read_outcome(outcome: Outcome, result: dict[str, Any], run_dir: Path) -> Outcome:
    """The figures of a finished run, from its ``result.json`` and ``metrics.csv``."""
    summary = result["summary"]
    outcome.final_return = summary.get("final_mean_return")
    outcome.steps_per_s = summary.get("env_steps_per_s")
    # The budget ends a run at the first update boundary at or past it (1,001,472 on 2t2r).
    if (summary.get("env_steps") or 0) < BUDGET:
        outcome.problem = f"ended at {summary.get('env_steps')} env steps, short of {BUDGET}"
    outcome.split = time_split(result)
    outcome.curve = learning_curve(run_dir / "metrics.csv")
    return outcome


def time_split(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Seconds per part of the loop, summed over the ranks of each role and over all ranks
    (``all``), from every rank's ``time_split_s``."""
    totals: dict[str, dict[str, float]] = {}
    for rank in result.get("ranks", []):
        parts = rank.get("result", {}).get("time_split_s")
        if not parts:
            continue
        for role in (rank["role"], "all"):
            into = totals.setdefault(role, {})
            for part, seconds in parts.items():
                into[part] = into.get(part, 0.0) + float(seconds)
    return totals


def shares(parts: dict[str, float]) -> dict[str, float]:
    """Each part's share of the loop time (the ``loop`` entry)."""
    whole = parts.get("loop", 0.0)
    return {k: v / whole for k, v in parts.items() if k != "loop"} if whole > 0 else {}


def learning_curve(metrics_csv: Path) -> list[tuple[float, float, float]]:
    """(env steps, training wall s, mean return of the last 20 episodes) per update."""
    if not metrics_csv.exists():
        return []
    with metrics_csv.open() as handle:
        return [(float(r["env_steps"]), float(r["wall_s"]), float(r["return_window"]))
                for r in csv.DictReader(handle) if r["return_window"] not in ("", "nan")]


def run(settings: Settings) -> list[Row]:
    base = settings.out_dir / NAME
    outcomes: dict[str, list[Outcome]] = {kind: [] for kind in RUNS}
    kinds = list(RUNS)
    for index, seed in enumerate(SEEDS):
        for kind in (kinds if index % 2 == 0 else kinds[::-1]):  # alternating order
            print(f"   {ENV_ID} {kind} seed {seed} ...", flush=True)
            outcomes[kind].append(run_one(kind, seed, base / f"{kind}-seed{seed}", RUN_TIMEOUT_S))
    plot_learning_curves(outcomes, base / "hopper_learning_curves.png")
    return rows_of(outcomes)


def rows_of(outcomes: dict[str, list[Outcome]]) -> list[Row]:
    rows: list[Row] = []
    for kind, runs in outcomes.items():
        label = f"{ENV_ID} {kind}" + (" (2t2r)" if kind == "default" else "")
        problems = [o.problem for o in runs if o.problem]
        loads = "; ".join(f"{a} -> {b}" for a, b in (o.load for o in runs) if a)
        seeds = f"seeds {list(SEEDS)}, median [min..max]"

        returns = [o.final_return for o in runs if o.final_return is not None]
        row = Row(NAME, f"{label}: return at 1M env steps", unit=NUMBER, goal=RETURN_GOAL,
                  reference_name="CleanRL ppo_continuous_action.py, Hopper-v4 (published)")
        row.reference = Stat.single(CLEANRL_RETURN)
        if returns:
            row.rlcomm = Stat.of(returns)
            row.ratio = Stat.of([r / CLEANRL_RETURN for r in returns])
        row.note = (f"{seeds}; CleanRL: {CLEANRL_RETURN:g} +/- {CLEANRL_STD:g}; mean of the "
                    "last 20 episodes at the budget")
        rows.append(_finish(row, problems))

        walls = [o.run.wall_s for o in runs if o.run is not None and o.run.result is not None]
        row = Row(NAME, f"{label}: wall time to 1M env steps (launch to exit)", unit=SECONDS,
                  goal=WALL_GOAL, reference_name="CleanRL ppo_continuous_action.py here")
        row.reference = Stat.single(CLEANRL_WALL_S)
        if walls:
            row.rlcomm = Stat.of(walls)
            row.ratio = ratios(walls, [CLEANRL_WALL_S] * len(walls))
        row.note = (f"{seeds}; CleanRL's: projected from its {CLEANRL_STEPS_PER_S:g} env "
                    f"steps/s measured here on {CLEANRL_MEASURED_ON}; load averages (1/5/15 "
                    f"min) before -> after each run: {loads}")
        rows.append(_finish(row, problems))

        rates = [o.steps_per_s for o in runs if o.steps_per_s]
        row = Row(NAME, f"{label}: env steps/s (updates included)", unit=PER_SECOND,
                  goal=RATE_GOAL, reference_name="CleanRL ppo_continuous_action.py here")
        row.reference = Stat.single(CLEANRL_STEPS_PER_S)
        if rates:
            row.rlcomm = Stat.of(rates)
            row.ratio = ratios(rates, [CLEANRL_STEPS_PER_S] * len(rates))
        row.note = seeds
        rows.append(_finish(row, problems))

        per_run = [shares(o.split["all"]) for o in runs if "all" in o.split]
        by_role = _role_note([o.split for o in runs if o.split])
        for index, (part, words) in enumerate(SPLIT.items()):
            values = [s[part] for s in per_run if part in s]
            row = Row(NAME, f"{label}: share of rank time in {words}", unit=NUMBER)
            if values:
                row.rlcomm = Stat.of(values)
            row.note = f"measured (time_split_s), all ranks' loop time together; {seeds}"
            if part == "comm":
                row.note += "; time blocked on other ranks included"
            if index == 0:
                row.note += f"; {by_role}"
            row.extra.update(per_seed=values)
            rows.append(_finish(row, problems))
    return rows


def _finish(row: Row, problems: list[str]) -> Row:
    if problems:
        row.note += "; " + "; ".join(problems)
    if row.rlcomm is None:
        row.status = "failed" if problems else "skipped"
        row.note += "" if problems else "; no value in any run"
    return row


def _role_note(splits: list[dict[str, dict[str, float]]]) -> str:
    """Median shares per role, e.g. ``rollout: env 41%, act 9%, ...``."""
    words = []
    for role in ROLES:
        per_run = [shares(s[role]) for s in splits if role in s]
        if not per_run:
            continue
        parts = [p for p in ("env", "act", "collect_other", "update", "comm", "other")
                 if any(r.get(p, 0.0) > 0.005 for r in per_run)]
        words.append(f"{role}: " + ", ".join(
            f"{p} {statistics.median(r.get(p, 0.0) for r in per_run):.0%}" for p in parts))
    return "per role (median): " + "; ".join(words) if words else ""


def plot_learning_curves(outcomes: dict[str, list[Outcome]], png: Path) -> None:
    """One row of panels per layout: return against env steps and against wall time, one line
    per seed, CleanRL's published final return +/- its std shaded."""
    if not any(o.curve for runs in outcomes.values() for o in runs):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(outcomes), 2, figsize=(11, 3.6 * len(outcomes)), sharey=True,
                             squeeze=False)
    for (kind, runs), panel in zip(outcomes.items(), axes):
        for ax, column, label in ((panel[0], 0, "env steps"),
                                  (panel[1], 1, "training wall time (s)")):
            ax.axhspan(CLEANRL_RETURN - CLEANRL_STD, CLEANRL_RETURN + CLEANRL_STD, color="grey",
                       alpha=0.2, label="CleanRL at 1M, published (Hopper-v4, mean +/- std)")
            for seed, outcome in zip(SEEDS, runs):
                if outcome.curve:
                    ax.plot([c[column] for c in outcome.curve], [c[2] for c in outcome.curve],
                            label=f"seed {seed}")
            ax.set_xlabel(label)
            ax.set_title(f"{ENV_ID}, {kind} layout"
                         + (" (1t2r, compiled)" if kind == "default" else ""))
        panel[0].set_ylabel("mean return of the last 20 episodes")
    axes[0][0].legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


# ---- reading the layout sweep (python -m app --multirun +experiment=mujoco_layouts) ---------


def sweep_table(sweep_dir: Path) -> str:
    """The layout sweep's answer with its reasons, as Markdown: per configuration (jobs that
    differ only in ``seed`` together; medians [min..max] over them), the time to the target
    return, the final return at the budget, env steps/s, CPU seconds per 1,000 env steps (all
    ranks together: what the cores must supply, whatever else ran) and the measured time split
    per role; fastest to the target first."""
    summary = json.loads((sweep_dir / "summary.json").read_text())
    jobs = [(job, _result(sweep_dir / str(job["job"]) / "result.json"))
            for job in summary["jobs"]]
    common = set.intersection(*(set(job["overrides"]) for job, _ in jobs)) if jobs else set()
    groups: dict[str, list[dict[str, Any] | None]] = {}
    for job, result in jobs:
        label = " ".join(o for o in job["overrides"]
                         if o not in common and not o.startswith("seed=")) or "(all)"
        groups.setdefault(label, []).append(result)
    targets = {d["summary"].get("target_return") for runs in groups.values() for d in runs if d}
    target = f"{targets.pop():,g}" if len(targets) == 1 else "the target"
    head = ["config", "seeds done", f"time to {target} (s)", "final return", "env steps/s",
            "CPU s per 1k env steps", "time split (median share of each role's loop time)"]
    rows = []
    for label, results in groups.items():
        done = [d for d in results if d is not None]
        metrics = [d["metrics"] for d in done]
        reach = [m["time_to_target_s"] for m in metrics if m.get("time_to_target_s") is not None]
        final = [m["final_mean_return"] for m in metrics if m.get("final_mean_return") is not None]
        rate = [m["env_steps_per_s"] for m in metrics if m.get("env_steps_per_s")]
        cpu = [1000 * sum(r["result"]["cpu_s"] for r in d["ranks"]) / d["summary"]["env_steps"]
               for d in done if d["summary"].get("env_steps")
               and all("cpu_s" in r["result"] for r in d["ranks"])]
        missed = len(done) - len(reach)
        cells = [label, f"{len(done)}/{len(results)}",
                 _spread(reach, "{:,.1f}") + (f" ({missed} not reached)" if missed else ""),
                 _spread(final, "{:,.0f}"), _spread(rate, "{:,.0f}"), _spread(cpu, "{:.2f}"),
                 _role_note([time_split(d) for d in done]).removeprefix("per role (median): ")]
        complete = bool(reach) and not missed
        rows.append(((not complete, statistics.median(reach) if reach else 0.0), cells))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for _, cells in sorted(rows, key=lambda r: r[0])]
    return "\n".join(lines) + "\n"


def _result(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _spread(values: list[float], form: str) -> str:
    if not values:
        return "-"
    mid = form.format(statistics.median(values))
    if len(values) == 1:
        return mid
    return f"{mid} [{form.format(min(values))}..{form.format(max(values))}]"


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "summary.json").exists():
        sys.exit("usage: python -m benchmarks.mujoco SWEEP_DIR  (a mujoco_layouts sweep's dir)")
    print(sweep_table(Path(sys.argv[1])), end="")
