"""The rows and figures a run records: one metrics row per update, the figures that compare
jobs (``result["metrics"]``, declared on ``PPOLoop.metrics``), the time split and the replay's
part of result.json. Rates are this attempt's: after a resume, the env steps taken since it
over the time since it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.runtime.rollout.worker import Episode
from rlcomm import CommContext, ParallelMode, collectives

# metrics.csv's columns that count things: written as integers (``2048``, not ``2048.0``). They
# come from the row below, the hand-off (``segments``, ``members``, ``epoch``, ``staleness``),
# evaluations (app/runtime/evaluation/evaluator.py) and an off-policy update's replay
# (app/runtime/replay/offpolicy.py); a count averaged over the trainers that is not whole, or NaN in
# a row without it, is written as it is.
COUNT_COLUMNS = frozenset({
    "update", "env_steps", "episodes", "weights_version",
    "segments", "members", "epoch", "staleness", "trainers",
    "eval_version", "eval_env_steps",
    "replay_size", "replay_inserts", "replay_samples", "learner_steps", "learner_wait",
})


@dataclass(frozen=True)
class UpdateRecord:
    """What one update adds to the records: the Recorder makes its metrics row of it.
    ``attempt_steps`` and ``elapsed``: env steps and seconds since this attempt started;
    ``new``: the episodes that finished in it; ``recent``: the stop rule's mean return;
    ``transfer_s``: this rank's weight-sending seconds so far; ``shared``: the hand-off's and
    the evaluations' figures; ``losses``: what this rank's update returned (empty off trainers)."""

    update: int
    env_steps: int
    attempt_steps: int
    elapsed: float
    version: int
    new: list[Episode]
    recent: float
    transfer_s: float
    shared: dict[str, float]
    losses: dict[str, float]
    episodes_done: int = 0


def update_row(record: UpdateRecord, losses: dict[str, float], transfer_total: float,
               transfer_before: float) -> dict[str, float]:
    """One update's metrics row: ``record`` with ``losses`` (the trainers' mean, or NaN on a
    rank that trains not) and the trainers' weight-sending seconds, in total and before it."""
    new = record.new
    return {
        "update": record.update,
        "env_steps": record.env_steps,
        "wall_s": record.elapsed,
        "mean_return": float(np.mean([r for r, _ in new])) if new else float("nan"),
        "return_window": record.recent if record.recent > float("-inf") else float("nan"),
        "mean_length": float(np.mean([n for _, n in new])) if new else float("nan"),
        "episodes": len(new),
        "env_steps_per_s": record.attempt_steps / record.elapsed if record.elapsed else 0.0,
        "weights_version": record.version,
        "transfer_s_total": transfer_total,
        "transfer_s": transfer_total - transfer_before,
        **record.shared,
        **losses,
    }


@dataclass(frozen=True)
class Attempt:
    """This attempt's totals on one rank, for the job's figures: ``elapsed`` seconds,
    ``updates`` and env ``steps``, weight-sending (``transfer_s``) and blocked (``wait_s``)
    seconds, when and at how many env steps the target was reached (``reached_at``), and the
    stop rule's mean return (``recent``, -inf before ``window`` episodes finished)."""

    elapsed: float
    updates: int
    steps: int
    transfer_s: float
    wait_s: float
    reached_at: tuple[float, int] | None
    recent: float


def job_metrics(ctx: CommContext, is_trainer: bool, attempt: Attempt,
                over: ParallelMode = ParallelMode.GLOBAL) -> dict[str, float | None]:
    """The figures that compare jobs, the same on every rank: per-role times are summed over
    ``over`` in one collective, so the fractions are the whole job's (an elastic run's
    trainers: its rollout ranks come and go, so their share is not summed)."""
    elapsed, wait_s, reached_at = attempt.elapsed, attempt.wait_s, attempt.reached_at
    rollout = not is_trainer
    totals = collectives.all_reduce_dict(ctx, over, {
        "trainers": float(is_trainer),
        "trainer_s": elapsed if is_trainer else 0.0,
        "trainer_wait_s": wait_s if is_trainer else 0.0,
        "transfer_s": attempt.transfer_s,
        "rollouts": float(rollout),
        "rollout_s": elapsed if rollout else 0.0,
        "rollout_wait_s": wait_s if rollout else 0.0,
    })

    def share(part: float, whole: float) -> float | None:
        return round(part / whole, 4) if whole > 0 else None

    return {
        "env_steps_per_s": round(attempt.steps / elapsed, 1) if elapsed else None,
        "time_to_target_s": round(reached_at[0], 2) if reached_at else None,
        "env_steps_to_target": reached_at[1] if reached_at else None,
        "reached_target": 1 if reached_at else 0,
        "updates_per_s": round(attempt.updates / elapsed, 2) if elapsed else None,
        "transfer_s": round(totals["transfer_s"] / totals["trainers"], 3),
        "transfer_share": share(totals["transfer_s"], totals["trainer_s"]),
        "trainer_wait_fraction": share(totals["trainer_wait_s"], totals["trainer_s"]),
        "rollout_wait_fraction": share(totals["rollout_wait_s"], totals["rollout_s"]),
        "final_mean_return": round(attempt.recent, 2) if attempt.recent > float("-inf") else None,
    }


def time_split(split_s: Mapping[str, float], elapsed: float) -> dict[str, float]:
    """Where a rank's time in the run (``loop``: all of it, this attempt's) went, measured:
    stepping the envs (``env``), the policy's forward and sampling (``act``), the rest of
    collecting (``collect_other``: normalising, packing), the update (``update``: DDP's
    gradient all-reduce included), communication (``comm``: segments, weights, episodes and the
    normalisers' statistics, time blocked on other ranks included) and the rest (``other``:
    records, checkpoints, the progress line). Zero for what a role does not do. ``split_s``:
    the rank's measured ``collect``, ``env``, ``act``, ``update`` and ``comm`` seconds."""
    env, act = split_s.get("env", 0.0), split_s.get("act", 0.0)
    parts = {"env": env, "act": act, "collect_other": split_s.get("collect", 0.0) - env - act,
             "update": split_s.get("update", 0.0), "comm": split_s.get("comm", 0.0)}
    parts["other"] = elapsed - sum(parts.values())
    return {name: round(value, 3) for name, value in {**parts, "loop": elapsed}.items()}


def declared_figures(declared: Any, losses: tuple[str, ...],
                     last: Mapping[str, float] | None) -> dict[str, float | None]:
    """The last update's figures of the algorithm's (``losses``) that its loop declares as
    metrics (``declared``: ``RLLoop.metrics.directions``), for a sweep to rank by (None where
    a rank trained not). ``last``: the last update's row."""
    last = last or {}
    figures = {}
    for name in losses:
        if name in declared:
            value = last.get(name, float("nan"))
            figures[name] = round(float(value), 6) if np.isfinite(value) else None
    return figures


def replay_result(last: Mapping[str, float] | None, waited: int) -> dict[str, Any]:
    """An off-policy run's replay as its last update left it (result.json's ``replay``), from
    its last metrics row, and ``waited``: the updates in which the limiter held the learner
    back, over the run; empty for any other run, and on a rank that trains not (its rows hold
    NaN: a static rollout rank's, a replay rank's)."""
    last = last or {}
    if not math.isfinite(last.get("replay_size", math.nan)):
        return {}
    names = ("replay_size", "replay_inserts", "replay_samples", "samples_per_insert",
             "priority_spread", "collector_wait_s", "learner_wait_s")
    return {"replay": {**{n: round(float(last[n]), 4) for n in names},
                       "learner_wait_updates": waited}}
