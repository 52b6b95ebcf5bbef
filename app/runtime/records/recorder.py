"""The Recorder: a deciding rank's records of its run, fed one :class:`UpdateRecord` per update.

Every rank that takes the stop decision makes the update's metrics row (trainers average their
losses over TRAIN_DATA_PARALLEL here) and keeps what its figures read: the last row and a few
sums, never the run's history. Rank 0 writes the history through to ``metrics.csv`` and
``episodes.csv`` (app/runtime/records/history.py), shows the progress line, feeds its experiment
trackers (TensorBoard, W&B, MLflow: app/output/trackers/) and draws ``learning_curve.png`` at
the end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.output import pictures
from app.output.background import in_background
from app.output.learning_curve import plot_learning_curve
from app.output.progress import RunProgress, Snapshot, StopRule
from app.output.trackers import Tracking
from app.runtime.evaluation.evaluator import Evaluation
from app.runtime.records.history import (
    EPISODE_COLUMNS,
    EPISODES_CSV,
    METRICS_CSV,
    HistoryFile,
    Offset,
    offset_after_update,
)
from app.runtime.records.rows import (
    COUNT_COLUMNS,
    Attempt,
    UpdateRecord,
    declared_figures,
    job_metrics,
    replay_result,
    update_row,
)
from rlcomm import CommContext, ParallelMode, collectives


@dataclass(frozen=True)
class RecordsMark:
    """How far a run's records were at a checkpoint: each history file's :class:`Offset` (a
    resume in the same run dir cuts the files back to them) and what the summary counts over
    the whole run. A checkpoint keeps it as plain values (:meth:`as_saved`)."""

    files: Mapping[str, Offset] = field(default_factory=dict)
    learner_wait_updates: int = 0

    def as_saved(self) -> dict[str, Any]:
        return {"files": {name: o.as_list() for name, o in self.files.items()},
                "learner_wait_updates": self.learner_wait_updates}

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any]) -> RecordsMark:
        return cls({name: Offset.from_saved(o) for name, o in saved.get("files", {}).items()},
                   int(saved.get("learner_wait_updates", 0)))

    @classmethod
    def of_checkpoint(cls, saved: Mapping[str, Any], run_dir: Path) -> RecordsMark:
        """The mark a checkpoint of this run recorded; one written before checkpoints recorded
        it (format 4) held every metrics row instead: metrics.csv is cut after its update."""
        if "history" in saved:
            return cls.from_saved(saved["history"])
        offset = offset_after_update(run_dir / METRICS_CSV, int(saved["update"]))
        return cls({METRICS_CSV: offset})


class Recorder:
    """One deciding rank's records and, on rank 0, everything written from them.

    ``trainers``: how many there are, on a trainer (its losses are averaged over them); None on
    a rank that trains not (its rows carry NaN losses, and it takes part in no collective here:
    a collective with the rollout ranks would make them wait every update). ``resumed``: where
    the records of this run stood at the checkpoint a restart resumed from (None: a new run, or
    one resumed from another run's checkpoint). ``outputs``: (progress line, trackers), as
    ``loop.progress`` and ``loop.trackers`` ask; only rank 0 writes any file. The trackers stay
    open past :meth:`close`, until the run's summary is known (app/launch/rank.py)."""

    def __init__(self, ctx: CommContext, run_dir: Path, name: str, loss_names: tuple[str, ...],
                 trainers: int | None, resumed: RecordsMark | None,
                 outputs: tuple[StopRule | None, Tracking | None], title: str = "") -> None:
        self.ctx, self.run_dir, self.name = ctx, run_dir, name
        self.loss_names, self.trainers = loss_names, trainers
        writes = ctx.get_global_rank() == 0
        rule, tracking = outputs
        at = resumed.files if resumed is not None else {}
        self.files: dict[str, HistoryFile] = {} if not writes or trainers is None else {
            METRICS_CSV: HistoryFile(run_dir / METRICS_CSV, COUNT_COLUMNS, at.get(METRICS_CSV)),
            EPISODES_CSV: HistoryFile(run_dir / EPISODES_CSV, EPISODE_COUNTS,
                                      at.get(EPISODES_CSV)),
        }
        self.view = RunProgress(rule, name) if writes and rule is not None else None
        self.trackers = (tracking.open(run_dir, name, title or name)
                         if writes and tracking is not None else None)
        # What the figures read: the last row, and sums over this attempt or the whole run.
        self.last: dict[str, float] | None = None
        self.rollout_wait_s = 0.0  # this attempt's rows
        self.learner_wait_updates = resumed.learner_wait_updates if resumed is not None else 0
        self.agreed: dict[str, bool] = {}  # the last record's flags, as the trainers agreed

    def record(self, record: UpdateRecord,
               asks: Mapping[str, bool] | None = None) -> dict[str, float]:
        """The update's row, kept (and written through on rank 0, with its episodes).
        ``asks``: flags this rank raises (a checkpoint is due, a stop was asked), agreed over
        the trainers in the same collective as their losses: :attr:`agreed` says whether any
        trainer raised each (on a rank that trains not: its own)."""
        asks = dict(asks or {})
        before = self.last["transfer_s_total"] if self.last else 0.0
        live = float("nan")
        if self.trainers is not None:
            flags = {f"ask/{name}": float(raised) for name, raised in asks.items()}
            reduced = collectives.all_reduce_dict(
                self.ctx, ParallelMode.TRAIN_DATA_PARALLEL,
                {"transfer_s": record.transfer_s, "trainers": 1.0, **record.losses, **flags})
            live = reduced["trainers"]  # the trainers live now (elastic trainers: fewer)
            losses = {k: reduced[k] / live for k in self.loss_names}
            total = reduced["transfer_s"]
            self.agreed = {name: reduced[f"ask/{name}"] > 0 for name in asks}
        else:
            losses, total = dict.fromkeys(self.loss_names, float("nan")), before
            self.agreed = asks
        row = {**update_row(record, losses, total, before), "trainers": live}
        self._count(row)
        if self.files:
            self.files[METRICS_CSV].append([row])
            self.files[EPISODES_CSV].append(episode_rows(record))
        return row

    def mark(self) -> RecordsMark:
        """Where the records stand now, for a checkpoint."""
        return RecordsMark({name: f.offset for name, f in self.files.items()},
                           self.learner_wait_updates)

    def sync(self) -> None:
        """The history written so far, durable (before a checkpoint that records it)."""
        for history in self.files.values():
            history.sync()

    def show(self, row: dict[str, float], record: UpdateRecord, episodes: int,
             evaluated: Evaluation | None) -> None:
        """The row on rank 0's progress line and to its trackers. ``episodes``: finished so
        far; ``evaluated``: the last evaluation, if any."""
        if self.trackers is not None:
            self.trackers.log({**row, "mean_return_window": record.recent}, record.env_steps)
        if self.view is not None:
            self.view.update(_snapshot(row, record, episodes, evaluated))

    def waiting(self, what: str) -> None:
        """The progress line says what the run waits for (the hand-off's ``on_wait``)."""
        if self.view is not None:
            self.view.waiting(what)

    def close(self, target: float | None, title: str) -> None:
        """The run ended: the progress line's last state, the history files closed and the
        learning curve drawn from metrics.csv (in the background)."""
        if self.view is not None:
            self.view.close()  # after the last checkpoint notice: the bar is the run's last line
        if not self.files:
            return
        for history in self.files.values():
            history.close()
        metrics = self.files[METRICS_CSV]
        if metrics.offset.rows:
            in_background(pictures.draw, plot_learning_curve, metrics.path,
                          self.run_dir / "learning_curve.png", target, title,
                          name="learning curve")

    def figures(self, attempt: Attempt, over: ParallelMode, declared: Any) -> dict[str, Any]:
        """The job's figures (result.json's ``metrics``, the same on every deciding rank: a
        collective over ``over``) with the algorithm's ``declared`` ones, and the replay's part
        of result.json."""
        metrics: dict[str, Any] = job_metrics(self.ctx, self.trainers is not None, attempt, over)
        return {"metrics": {**metrics, **declared_figures(declared, self.loss_names, self.last)},
                **replay_result(self.last, self.learner_wait_updates)}

    def rollout_wait_fraction(self, elapsed: float) -> float:
        """An elastic run's: the rollout ranks' waits came with their segments, per row."""
        return round(self.rollout_wait_s / elapsed, 4)

    def _count(self, row: dict[str, float]) -> None:
        self.last = row
        self.rollout_wait_s += row.get("rollout_wait_s", 0.0)
        waited = row.get("learner_wait", math.nan)
        if math.isfinite(waited):
            self.learner_wait_updates += int(waited)


def episode_rows(record: UpdateRecord) -> list[dict[str, float]]:
    """``episodes.csv``'s rows of the episodes that finished in ``record``'s update."""
    first = record.episodes_done - len(record.new) + 1
    return [dict(zip(EPISODE_COLUMNS, (first + i, record.update, record.env_steps, ret, length)))
            for i, (ret, length) in enumerate(record.new)]


EPISODE_COUNTS = frozenset({"episode", "update", "env_steps", "length"})


def _snapshot(row: dict[str, float], record: UpdateRecord, episodes: int,
              evaluated: Evaluation | None) -> Snapshot:
    return Snapshot(
        env_steps=record.env_steps,
        mean_return=record.recent,
        episodes=episodes,
        env_steps_per_s=row["env_steps_per_s"],
        weights_version=int(row["weights_version"]),
        elapsed_s=record.elapsed,
        members=int(row["members"]) if "members" in row else None,
        eval_return=evaluated.return_mean if evaluated else None,
        eval_version=evaluated.version if evaluated else None,
        replay_size=int(row["replay_size"]) if "replay_size" in row else None,
        samples_per_insert=row.get("samples_per_insert"),
        limiter_wait_s=((row["collector_wait_s"], row["learner_wait_s"])
                        if "collector_wait_s" in row else None),
    )
