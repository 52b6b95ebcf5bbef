"""The Recorder: a deciding rank's records of its run, fed one :class:`UpdateRecord` per update.

Every rank that takes the stop decision keeps the metrics rows (trainers average their losses
over TRAIN_DATA_PARALLEL here); rank 0 also writes them through to ``metrics.csv``, shows the
progress line, feeds its experiment trackers (TensorBoard, W&B, MLflow: app/output/trackers/)
and draws ``learning_curve.png`` at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.output import pictures
from app.output.background import in_background
from app.output.learning_curve import plot_learning_curve
from app.output.progress import RunProgress, Snapshot, StopRule
from app.output.trackers import Tracking
from app.runtime.evaluation.evaluator import Evaluation
from app.runtime.records.metrics_file import MetricsFile
from app.runtime.records.rows import (
    Attempt,
    UpdateRecord,
    declared_figures,
    job_metrics,
    replay_result,
    update_row,
)
from rlcomm import CommContext, ParallelMode, collectives


class Recorder:
    """One deciding rank's metrics rows and, on rank 0, everything written from them.

    ``trainers``: how many there are, on a trainer (its losses are averaged over them); None on
    a rank that trains not (its rows carry NaN losses, and it takes part in no collective here:
    a collective with the rollout ranks would make them wait every update). ``rows``: those a
    resumed run recorded before this attempt. ``outputs``: (progress line, trackers), as
    ``loop.progress`` and ``loop.trackers`` ask; only rank 0 writes any file. The trackers stay
    open past :meth:`close`, until the run's summary is known (app/launch/rank.py)."""

    def __init__(self, ctx: CommContext, run_dir: Path, name: str, loss_names: tuple[str, ...],
                 trainers: int | None, rows: list[dict[str, float]],
                 outputs: tuple[StopRule | None, Tracking | None], title: str = "") -> None:
        self.ctx, self.run_dir, self.name = ctx, run_dir, name
        self.loss_names, self.trainers = loss_names, trainers
        self.rows = rows
        writes = ctx.get_global_rank() == 0
        rule, tracking = outputs
        self.metrics_file = (MetricsFile(run_dir / "metrics.csv", rows)
                             if writes and trainers is not None else None)
        self.view = RunProgress(rule, name) if writes and rule is not None else None
        self.trackers = (tracking.open(run_dir, name, title or name)
                         if writes and tracking is not None else None)

    def record(self, record: UpdateRecord) -> dict[str, float]:
        """The update's row, kept (and written through on rank 0)."""
        before = self.rows[-1]["transfer_s_total"] if self.rows else 0.0
        live = float("nan")
        if self.trainers is not None:
            reduced = collectives.all_reduce_dict(
                self.ctx, ParallelMode.TRAIN_DATA_PARALLEL,
                {"transfer_s": record.transfer_s, "trainers": 1.0, **record.losses})
            live = reduced["trainers"]  # the trainers live now (elastic trainers: fewer)
            losses = {k: reduced[k] / live for k in self.loss_names}
            total = reduced["transfer_s"]
        else:
            losses, total = dict.fromkeys(self.loss_names, float("nan")), before
        row = {**update_row(record, losses, total, before), "trainers": live}
        self.rows.append(row)
        if self.metrics_file is not None:
            self.metrics_file.append(row)
        return row

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
        """The run ended: the progress line's last state, metrics.csv closed and the learning
        curve drawn from it (in the background)."""
        if self.view is not None:
            self.view.close()  # after the last checkpoint notice: the bar is the run's last line
        if self.metrics_file is None:
            return
        self.metrics_file.close()
        if self.rows:
            in_background(pictures.draw, plot_learning_curve, self.metrics_file.path,
                          self.run_dir / "learning_curve.png", target, title,
                          name="learning curve")

    def figures(self, attempt: Attempt, over: ParallelMode, declared: Any) -> dict[str, Any]:
        """The job's figures (result.json's ``metrics``, the same on every deciding rank: a
        collective over ``over``) with the algorithm's ``declared`` ones, and the replay's part
        of result.json."""
        metrics: dict[str, Any] = job_metrics(self.ctx, self.trainers is not None, attempt, over)
        return {"metrics": {**metrics, **declared_figures(declared, self.loss_names, self.rows)},
                **replay_result(self.rows)}

    def rollout_wait_fraction(self, updates: int, elapsed: float) -> float:
        """An elastic run's: the rollout ranks' waits came with their segments, per row."""
        waited = sum(row["rollout_wait_s"] for row in self.rows[-updates:] if updates)
        return round(waited / elapsed, 4)


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
