"""7. Lockstep against bounded staleness: ``python -m app loop.max_staleness=0`` (lockstep)
against ``loop.max_staleness=1`` (rollouts collect while trainers update), on the 2t2r and 1t3r
layouts, each with the same ``SEEDS``; and, at ``max_staleness=1``, the two corrections for data
that lags the weights: PPO's decoupled clip against IMPALA's V-trace (``loop=vtrace``). Rows: env
steps/s, time to the target return and the fraction of wall time trainers and rollouts spent
waiting on each other; each side is the median of the seeds (with min and max), the ratio is per
seed (same seed: k=1 / lockstep, and V-trace / PPO at k=1).

Eighteen runs of about 20 s each on an idle 2-core machine: this section does not fit the shared
10-minute budget, so each run gets ``RUN_TIMEOUT_S`` whatever is left of it (``--only
rl_staleness`` runs it alone). A run that does not finish, or ends without reaching the target,
leaves its metrics out (noted in the row).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from .core import NUMBER, PER_SECOND, SECONDS, Row, Settings, Stat, ratios
from .procs import CommandTimeoutError, timed_command

NAME = "rl_staleness"
SEEDS = (0, 1, 2)
LAYOUTS = ("2t2r", "1t3r")
# mode -> (loop, max_staleness)
MODES = {"lockstep": ("ppo", 0), "k=1": ("ppo", 1), "vtrace k=1": ("vtrace", 1)}
# (what is compared, against what, the row's words)
PAIRS = (("k=1", "lockstep", "k=1 vs lockstep"),
         ("vtrace k=1", "k=1", "k=1: V-trace vs PPO's decoupled clip"))
RUN_TIMEOUT_S = 180.0
METRICS = {  # metric -> unit
    "env steps/s": PER_SECOND,
    "time to return >= 475": SECONDS,
    "trainer waiting fraction": NUMBER,
    "rollout waiting fraction": NUMBER,
}


def run_one(layout: str, mode: str, seed: int, run_dir: Path, timeout: float) -> dict[str, float]:
    """One run's metrics; empty when it failed or timed out, no time when the target was missed."""
    loop, k = MODES[mode]
    argv = [
        sys.executable, "-m", "app", f"loop={loop}", f"layout={layout}", f"loop.max_staleness={k}",
        f"seed={seed}", "loop.progress=false", "loop.checkpoint_every=0",
        f"hydra.run.dir={run_dir}",
    ]
    try:
        _, done = timed_command(argv, timeout)
    except CommandTimeoutError:
        return {}
    result_file = run_dir / "result.json"
    if done.returncode != 0 or not result_file.exists():
        return {}
    return metrics_of(json.loads(result_file.read_text()))


def metrics_of(document: dict[str, Any]) -> dict[str, float]:
    """From result.json: rank 0's rates and time to target; waiting fractions per role (mean)."""
    ranks = document["ranks"]
    first = ranks[0]["result"]
    out = {"env steps/s": float(first["env_steps_per_s"])}
    if first.get("time_to_target_s") is not None:
        out["time to return >= 475"] = float(first["time_to_target_s"])
    for role in ("trainer", "rollout"):
        waits = [r["result"]["wait_fraction"] for r in ranks if r["role"] == role]
        if waits:
            out[f"{role} waiting fraction"] = float(statistics.mean(waits))
    return out


def run(settings: Settings) -> list[Row]:
    base = settings.out_dir / "rl_staleness"
    runs = [(layout, mode, seed) for layout in LAYOUTS for seed in SEEDS for mode in MODES]
    found: dict[tuple[str, str, int], dict[str, float]] = {}
    for layout, mode, seed in runs:
        run_dir = base / f"{layout}_{mode.replace('=', '')}_seed{seed}"
        found[(layout, mode, seed)] = run_one(layout, mode, seed, run_dir, RUN_TIMEOUT_S)
    rows = []
    for ours, theirs, words in PAIRS:
        for layout in LAYOUTS:
            for metric, unit in METRICS.items():
                rows.append(_row(layout, metric, unit, found, (ours, theirs, words)))
    return rows


def _row(
    layout: str, metric: str, unit: str, found: dict[tuple[str, str, int], dict[str, float]],
    pair: tuple[str, str, str],
) -> Row:
    mode, against, words = pair
    row = Row(NAME, f"{layout} {metric}: {words}", unit=unit, reference_name=against)
    ours = {s: found[(layout, mode, s)].get(metric) for s in SEEDS}
    theirs = {s: found[(layout, against, s)].get(metric) for s in SEEDS}
    have_ours = [v for v in ours.values() if v is not None]
    have_theirs = [v for v in theirs.values() if v is not None]
    if have_ours:
        row.rlcomm = Stat.of(have_ours)
    if have_theirs:
        row.reference = Stat.of(have_theirs)
    paired = [s for s in SEEDS if ours[s] is not None and theirs[s] is not None and theirs[s]]
    if paired:
        row.ratio = ratios([ours[s] for s in paired], [theirs[s] for s in paired])  # type: ignore[misc]
    missing = [f"{name} seed {s}" for name, side in ((mode, ours), (against, theirs))
               for s in SEEDS if side[s] is None]
    row.note = f"median of seeds {list(SEEDS)} [min..max]"
    if missing:
        row.note += "; no value (failed, timed out or target not reached): " + ", ".join(missing)
    if not have_ours and not have_theirs:
        row.status = "skipped"
    row.extra.update(per_seed={mode: ours, against: theirs})
    return row
