"""11. Elastic rollout ranks (app/runtime/membership/rollouts.py, rlcomm.elastic).

- **Overhead.** Steady-state env steps/s of elastic rollouts (the default) against static
  groups (``layout.elastic_rollouts=false``), on 1t3r and 2t2r, seeds ``SEEDS``, each pair run
  back to back. Lockstep PPO trains the same trajectory either way (same losses, same env steps),
  so only the hand-off differs. Goal: elastic at most 2% slower (ratio >= 0.98).
- **Time to re-form.** ``layout=1t3r launcher.rollout_restarts=1``; rank 3 (the process named
  ``rlcomm-rank3``) is SIGKILLed once the run has trained ``KILL_AT_UPDATE`` updates. From the
  trainer's records in result.json: from the kill to the next update done with the two
  survivors, and from the restarted rank's admission to its first segment trained; and from the
  kill to that admission (the restart: a fork, imports already done, the store and the group).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from app.launch.environment import without_launcher_variables

from .core import PER_SECOND, SECONDS, Goal, Row, Settings, Stat, ratios
from .procs import REPO_ROOT, kill_rank

NAME = "elastic"
SEEDS = (0, 1, 2)
LAYOUTS = ("1t3r", "2t2r")
STEADY = ("loop.total_env_steps=200000", "loop.target_return=1e9", "loop.progress=false",
          "loop.checkpoint_every=0")
KILL_AT_UPDATE = 15
RUN_TIMEOUT_S = 240.0


def _run(args: list[str], run_dir: Path) -> dict[str, Any] | None:
    argv = [sys.executable, "-m", "app", *args, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(argv, cwd=REPO_ROOT, env=without_launcher_variables(os.environ),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    result = run_dir / "result.json"
    if done.returncode != 0 or not result.exists():
        print(done.stderr[-2000:], file=sys.stderr)
        return None
    document: dict[str, Any] = json.loads(result.read_text())
    return document


def overhead(settings: Settings) -> list[Row]:
    rows = []
    for layout in LAYOUTS:
        found: dict[str, dict[int, float]] = {"elastic": {}, "static": {}}
        for seed in SEEDS:
            for mode, flag in (("elastic", "true"), ("static", "false")):
                run_dir = settings.out_dir / NAME / f"{layout}_{mode}_seed{seed}"
                result = _run([f"layout={layout}", f"seed={seed}",
                               f"layout.elastic_rollouts={flag}", *STEADY], run_dir)
                if result is not None:
                    found[mode][seed] = float(result["ranks"][0]["result"]["env_steps_per_s"])
        row = Row(NAME, f"{layout} env steps/s: elastic vs static groups", unit=PER_SECOND,
                  reference_name="static", goal=Goal(">=", 0.98))
        if found["elastic"]:
            row.rlcomm = Stat.of(list(found["elastic"].values()))
        if found["static"]:
            row.reference = Stat.of(list(found["static"].values()))
        paired = [s for s in SEEDS if s in found["elastic"] and s in found["static"]]
        if paired:
            row.ratio = ratios([found["elastic"][s] for s in paired],
                               [found["static"][s] for s in paired])
        else:
            row.status = "failed"
        row.note = f"median of seeds {list(SEEDS)}, each pair back to back; 200k env steps"
        row.extra.update(per_seed=found)
        rows.append(row)
    return rows


def _kill_rank_when(run_dir: Path, proc: subprocess.Popen[str], rank: int,
                    update: int) -> float | None:
    """SIGKILLs the process ``rlcomm-rank<rank>`` under ``proc`` once metrics.csv has
    ``update`` rows; returns when (time.time())."""
    metrics = run_dir / "metrics.csv"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) > update:
            killed = kill_rank(proc.pid, rank)
            if killed is not None:
                return killed
        time.sleep(0.02)
    return None


def reform(settings: Settings) -> list[Row]:
    samples: dict[str, list[float]] = {"to next update": [], "to admission": [],
                                       "admission to first trained": []}
    for seed in SEEDS:
        run_dir = settings.out_dir / NAME / f"reform_seed{seed}"
        argv = [sys.executable, "-m", "app", "layout=1t3r", f"seed={seed}",
                "launcher.rollout_restarts=1", *STEADY, f"hydra.run.dir={run_dir}"]
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=without_launcher_variables(os.environ),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        killed = _kill_rank_when(run_dir, proc, 3, KILL_AT_UPDATE)
        try:
            proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        result = run_dir / "result.json"
        if killed is None or not result.exists():
            continue
        document = json.loads(result.read_text())
        leave = next((c for c in document.get("leaves", []) if c["rank"] == 3), None)
        join = next((c for c in document.get("joins", []) if c["rank"] == 3), None)
        if leave and leave.get("next_update_s") is not None:
            samples["to next update"].append(leave["time"] + leave["next_update_s"] - killed)
        if join:
            samples["to admission"].append(join["time"] - killed)
            if join.get("first_trained_s") is not None:
                samples["admission to first trained"].append(join["first_trained_s"])
    rows = []
    words = {"to next update": "rank 3 SIGKILLed -> next update with the 2 survivors",
             "to admission": "rank 3 SIGKILLed -> its restart admitted (rollout_restarts=1)",
             "admission to first trained": "admission -> the rejoined rank's first segment "
                                           "trained on"}
    for key, values in samples.items():
        row = Row(NAME, f"1t3r re-form: {words[key]}", unit=SECONDS)
        if values:
            row.rlcomm = Stat.of(values)
        else:
            row.status = "failed"
        row.note = f"median of seeds {list(SEEDS)}; killed after update {KILL_AT_UPDATE}"
        rows.append(row)
    return rows


def run(settings: Settings) -> list[Row]:
    return [*overhead(settings), *reform(settings)]

