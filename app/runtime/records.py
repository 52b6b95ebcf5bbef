"""What a run records: one metrics row per update (``metrics.csv``, TensorBoard, the
progress line), the figures that compare jobs (``result["metrics"]``, declared on
``PPOLoop.metrics``); ``learning_curve.png`` is drawn from ``metrics.csv``
(app/output/learning_curve.py).

Rates are this attempt's: after a resume, the env steps taken since it over the time since it.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from app.runtime.worker import Episode, RolloutWorker
from rlcomm import CommContext, ParallelMode, collectives

# metrics.csv's columns that count things: written as integers (``2048``, not ``2048.0``). They
# come from the row below, the hand-off (``segments``, ``members``, ``epoch``, ``staleness``),
# evaluations (app/runtime/evaluation/evaluator.py) and an off-policy update's replay
# (app/runtime/replay/offpolicy.py); a count averaged over the trainers that is not whole, or NaN in
# a row without it, is written as it is.
COUNT_COLUMNS = frozenset({
    "update", "env_steps", "episodes", "weights_version",
    "segments", "members", "epoch", "staleness",
    "eval_version", "eval_env_steps",
    "replay_size", "replay_inserts", "replay_samples", "learner_steps", "learner_wait",
})


def update_row(
    ctx: CommContext,
    trainers: int | None,
    previous: dict[str, float] | None,
    loss_names: tuple[str, ...],
    *,
    update: int,
    env_steps: int,
    attempt_steps: int,
    elapsed: float,
    version: int,
    new: list[Episode],
    recent: float,
    transfer_s: float,
    shared: dict[str, float],
    losses: dict[str, float],
) -> dict[str, float]:
    """One update's metrics row. ``trainers``: how many, on a trainer; None on a rollout rank.
    Only trainers reduce (over TRAIN_DATA_PARALLEL): a collective with the rollouts here would
    make them wait for every update. Rollouts' rows (never written) carry NaN losses.
    ``loss_names``: the figures the algorithm's update returns (``Algorithm.losses``).
    ``attempt_steps`` and ``elapsed``: env steps and seconds since this attempt started."""
    transfer_total = previous["transfer_s_total"] if previous else 0.0
    if trainers is not None:
        reduced = collectives.all_reduce_dict(
            ctx, ParallelMode.TRAIN_DATA_PARALLEL, {"transfer_s": transfer_s, **losses}
        )
        losses = {k: reduced[k] / trainers for k in loss_names}
        transfer_now = reduced["transfer_s"]
    else:
        losses = dict.fromkeys(loss_names, float("nan"))
        transfer_now = transfer_total
    return {
        "update": update,
        "env_steps": env_steps,
        "wall_s": elapsed,
        "mean_return": float(np.mean([r for r, _ in new])) if new else float("nan"),
        "return_window": recent if recent > float("-inf") else float("nan"),
        "mean_length": float(np.mean([n for _, n in new])) if new else float("nan"),
        "episodes": len(new),
        "env_steps_per_s": attempt_steps / elapsed if elapsed else 0.0,
        "weights_version": version,
        "transfer_s_total": transfer_now,
        "transfer_s": transfer_now - transfer_total,
        **shared,
        **losses,
    }


def job_metrics(
    ctx: CommContext,
    is_trainer: bool,
    *,
    elapsed: float,
    transfer_s: float,
    wait_s: float,
    reached_at: tuple[float, int] | None,
    updates: int,
    steps: int,
    recent: float,
    over: ParallelMode = ParallelMode.GLOBAL,
) -> dict[str, float | None]:
    """The figures that compare jobs, the same on every rank: per-role times are summed over
    GLOBAL in one collective, so the fractions are the whole job's. ``updates``, ``steps`` and
    ``elapsed``: this attempt's; ``recent``: the stop rule's mean return (-inf before
    ``window`` episodes finished). ``over``: the ranks summed (an elastic run's trainers: its
    rollout ranks come and go, so their share is not summed)."""
    rollout = not is_trainer
    totals = collectives.all_reduce_dict(ctx, over, {
        "trainers": float(is_trainer),
        "trainer_s": elapsed if is_trainer else 0.0,
        "trainer_wait_s": wait_s if is_trainer else 0.0,
        "transfer_s": transfer_s,
        "rollouts": float(rollout),
        "rollout_s": elapsed if rollout else 0.0,
        "rollout_wait_s": wait_s if rollout else 0.0,
    })

    def share(part: float, whole: float) -> float | None:
        return round(part / whole, 4) if whole > 0 else None

    return {
        "env_steps_per_s": round(steps / elapsed, 1) if elapsed else None,
        "time_to_target_s": round(reached_at[0], 2) if reached_at else None,
        "env_steps_to_target": reached_at[1] if reached_at else None,
        "reached_target": 1 if reached_at else 0,
        "updates_per_s": round(updates / elapsed, 2) if elapsed else None,
        "transfer_s": round(totals["transfer_s"] / totals["trainers"], 3),
        "transfer_share": share(totals["transfer_s"], totals["trainer_s"]),
        "trainer_wait_fraction": share(totals["trainer_wait_s"], totals["trainer_s"]),
        "rollout_wait_fraction": share(totals["rollout_wait_s"], totals["rollout_s"]),
        "final_mean_return": round(recent, 2) if recent > float("-inf") else None,
    }


def time_split(worker: RolloutWorker | None, split_s: dict[str, float],
               elapsed: float) -> dict[str, float]:
    """Where a rank's time in the run (``loop``: all of it, this attempt's) went, measured:
    stepping the envs (``env``), the policy's forward and sampling (``act``), the rest of
    collecting (``collect_other``: normalising, packing), the update (``update``: DDP's
    gradient all-reduce included), communication (``comm``: segments, weights, episodes and the
    normalisers' statistics, time blocked on other ranks included) and the rest (``other``:
    records, checkpoints, the progress line). Zero for what a role does not do. ``split_s``:
    the rank's measured ``collect``, ``update`` and ``comm`` seconds."""
    env = worker.env_s if worker is not None else 0.0
    act = worker.act_s if worker is not None else 0.0
    parts = {"env": env, "act": act, "collect_other": split_s["collect"] - env - act,
             "update": split_s["update"], "comm": split_s["comm"]}
    parts["other"] = elapsed - sum(parts.values())
    return {name: round(value, 3) for name, value in {**parts, "loop": elapsed}.items()}


def declared_figures(declared: Any, losses: tuple[str, ...],
                     rows: list[dict[str, float]]) -> dict[str, float | None]:
    """The last update's figures of the algorithm's (``losses``) that its loop declares as
    metrics (``declared``: ``RLLoop.metrics.directions``), for a sweep to rank by (None where
    a rank trained not)."""
    last = rows[-1] if rows else {}
    figures = {}
    for name in losses:
        if name in declared:
            value = last.get(name, float("nan"))
            figures[name] = round(float(value), 6) if np.isfinite(value) else None
    return figures


def replay_result(rows: list[dict[str, float]]) -> dict[str, Any]:
    """An off-policy run's replay as its last update left it (result.json's ``replay``), from
    its metrics rows; empty for any other run, and on a rank that trains not (its rows hold
    NaN: a static rollout rank's, a replay rank's)."""
    last = rows[-1] if rows else {}
    if not math.isfinite(last.get("replay_size", math.nan)):
        return {}
    names = ("replay_size", "replay_inserts", "replay_samples", "samples_per_insert",
             "priority_spread", "collector_wait_s", "learner_wait_s")
    waited = sum(int(row.get("learner_wait", 0)) for row in rows)
    return {"replay": {**{n: round(float(last[n]), 4) for n in names},
                       "learner_wait_updates": waited}}


class MetricsFile:
    """``metrics.csv``, one row appended and written through per update, so a run that fails
    keeps every row it recorded before. Counts (:data:`COUNT_COLUMNS`) are written as integers.
    A write that fails (a full disk) is cut back to the last whole row and re-raised naming the
    file.

    ``rows``: the rows recorded before this attempt (a resume in the same run dir): the file is
    rewritten with them aside and renamed, so the old file stays whole until the new one is."""

    def __init__(self, path: Path, rows: list[dict[str, float]]) -> None:
        self.path = path
        self._handle: io.FileIO | None = None
        self._fields: list[str] = []
        self._size = 0  # bytes of whole rows written
        if rows:
            self._start(rows)

    def append(self, row: dict[str, float]) -> None:
        if self._handle is None:
            self._start([row])
        else:
            self._write(self._handle, self._encode([row], header=False))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def _start(self, rows: list[dict[str, float]]) -> None:
        self._fields = list(rows[0])
        partial = self.path.with_name(f"{self.path.name}.tmp")
        try:
            handle = io.FileIO(partial, "w")
        except OSError as err:
            err.filename = str(self.path)
            raise
        try:
            self._size = 0
            self._write(handle, self._encode(rows, header=True))
            os.replace(partial, self.path)
        except BaseException:
            handle.close()
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            raise
        self._handle = handle

    def _encode(self, rows: list[dict[str, float]], header: bool) -> bytes:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self._fields)
        if header:
            writer.writeheader()
        writer.writerows(_typed(row) for row in rows)
        return text.getvalue().encode()

    def _write(self, handle: io.FileIO, data: bytes) -> None:
        """All of ``data``, unbuffered (a short write goes on where it stopped), or nothing."""
        try:
            view = memoryview(data)
            while view:
                view = view[handle.write(view) or 0 :]
        except OSError as err:
            with contextlib.suppress(OSError):  # shrinking a file needs no room
                os.ftruncate(handle.fileno(), self._size)
            err.filename = str(self.path)
            raise
        self._size += len(data)


def _typed(row: dict[str, float]) -> dict[str, float]:
    """``row`` with each whole count an int, as metrics.csv writes it."""
    return {name: int(value) if name in COUNT_COLUMNS and float(value).is_integer() else value
            for name, value in row.items()}
