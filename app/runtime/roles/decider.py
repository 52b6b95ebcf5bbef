"""The decider role: a rank that takes the stop decision with the others that do.

Those are every rank, or an elastic run's trainers (its rollout ranks and replay ranks follow
their trainers, which tell them when the run stops). Deciders learn every episode of the job
from the hand-off, so they all stop at the same update. Each records every update (its
:class:`~app.runtime.records.recorder.Recorder`), takes part in the evaluations where the run
has them, and, on a trainer, checkpoints (its
:class:`~app.runtime.checkpoints.checkpointer.Checkpointer`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from app.runtime.checkpoints.checkpointer import Checkpointer
from app.runtime.core import stopping
from app.runtime.core.state import RunState
from app.runtime.evaluation.evaluator import Evaluations, evaluation_row
from app.runtime.records.recorder import Recorder
from app.runtime.records.rows import Attempt, UpdateRecord
from app.runtime.rollout.worker import Agent, Episode
from app.runtime.settings import RunSettings
from app.runtime.settings.builders import target
from rlcomm import ParallelMode

log = logging.getLogger(__name__)
_CLOSING_WRITE_S = 10.0  # a failed run waits this long, at most, for a checkpoint in flight


class Decider:
    """Records, checks the target and checkpoints after each update; ``over``: the deciding
    ranks' mode (GLOBAL, or TRAIN_DATA_PARALLEL on an elastic run). ``started``: when this
    attempt's loop started (perf_counter) and the env steps it started at; ``votes_stop``:
    whether this rank asks the others to stop (SIGTERM to it; an elastic trainer other than the
    lead leaves instead)."""

    def __init__(self, loop: RunSettings, state: RunState, over: ParallelMode,
                 recorder: Recorder, checkpointer: Checkpointer | None,
                 evaluations: Evaluations | None, started: tuple[float, int],
                 votes_stop: Callable[[], bool] = stopping.asked) -> None:
        self.loop, self.state, self.over = loop, state, over
        self.votes_stop = votes_stop  # whether this rank asks the others to stop (SIGTERM)
        self.recorder, self.checkpointer, self.evaluations = recorder, checkpointer, evaluations
        self.start, self.first_steps = started
        self.target = target(loop)  # with loop.stop_at_target=false: noted, not the end
        self.stopped_by: str | None = None  # a stop asked from outside (SIGTERM), once agreed

    def more_steps(self) -> bool:
        return self.state.env_steps < self.loop.total_env_steps

    def share_evaluation(self, shared: dict[str, float]) -> None:
        """After the hand-off (every decider is there): an evaluation that came back, into
        the update's row."""
        if self.evaluations is not None:
            shared.update(evaluation_row(self.evaluations.share()))

    def after_update(self, version: int, new: list[Episode], losses: dict[str, float],
                     shared: dict[str, float], transfer_s: float, asked: bool) -> bool:
        """Records the update, notes the first time the target is reached (before a checkpoint
        due now, which keeps it), checkpoints when the trainers agree one is due; True when the
        run ends here: the target is reached (``loop.stop_at_target``), or a stop was asked
        (SIGTERM) and the deciders agree on it (``asked``: on a static layout, any rank's ask
        as the hand-off brought it; otherwise the trainers agree through their records)."""
        state, elapsed = self.state, time.perf_counter() - self.start
        record = UpdateRecord(
            update=state.update, env_steps=state.env_steps,
            attempt_steps=state.env_steps - self.first_steps, elapsed=elapsed, version=version,
            new=new, recent=state.recent_return(self.loop.window), transfer_s=transfer_s,
            shared=shared, losses=losses, episodes_done=state.episodes_done)
        checkpointer = self.checkpointer
        due = checkpointer is not None and checkpointer.due(state)
        row = self.recorder.record(record, {"checkpoint": due, "stop": self.votes_stop()})
        agreed = self.recorder.agreed
        if self.over is not ParallelMode.GLOBAL:
            asked = agreed["stop"]
        last = self.evaluations.last if self.evaluations is not None else None
        self.recorder.show(row, record, state.episodes_done, last)
        reached = self.target is not None and self._quantity() >= self.target
        if reached and state.reached_at is None:  # the first time counts, over every attempt
            state.reached_at = (state.training_s(), state.env_steps)
        if checkpointer is not None:
            checkpointer.check()  # a background write that failed ends the run here
            if agreed["checkpoint"] and not asked:  # a stop's checkpoint is the last one
                checkpointer.save(state, self.recorder.mark().as_saved(), self.recorder.sync)
        if asked:
            self.stopped_by = stopping.reason() or "SIGTERM"  # another rank's, if not ours
            log.info("stopped: asked by %s at update %d", self.stopped_by, state.update)
        return (reached and self.loop.stop_at_target) or asked

    def evaluate(self, version: int, agent: Agent) -> None:
        """Every ``loop.eval_every`` updates: the weights just sent (with the normalisers'
        statistics) to the lead trainer's evaluator; with them, what ``checkpoints/best`` would
        hold."""
        evaluations, state = self.evaluations, self.state
        if evaluations is None or state.update % self.loop.eval_every:
            return
        if evaluations.process is None:
            return
        best = self.checkpointer.best(state) if self.checkpointer is not None else None
        evaluations.submit(version, state.update, state.env_steps, agent.state_dict(), best)

    def finish(self, timeout_s: float) -> None:
        """The run stopped: the evaluation still running completes the record."""
        if self.evaluations is not None:
            self.evaluations.finish(timeout_s)

    def save_final(self) -> None:
        """The run's last checkpoint (unless the last update's holds it), durable."""
        if self.checkpointer is not None:
            self.checkpointer.save_final(self.state, self.recorder.mark().as_saved(),
                                         self.recorder.sync)

    def close(self) -> None:
        """The run failed: the evaluator process ends with it, and a checkpoint being written
        is given a moment to become durable (it holds a good state)."""
        if self.evaluations is not None:
            self.evaluations.close()
        if self.checkpointer is not None:
            with contextlib.suppress(Exception):
                self.checkpointer.writes.wait(_CLOSING_WRITE_S)

    def result(self, attempt: Attempt, declared: Any) -> dict[str, Any]:
        """This rank's decider part of result.json: the job's figures and the run's outcome."""
        reached_at, recent = self.state.reached_at, attempt.recent
        figures = self.recorder.figures(attempt, self.over, declared)
        metrics = figures["metrics"]
        # Rollout ranks that take no part in the decision sent their waits with their segments.
        if self.over is not ParallelMode.GLOBAL and attempt.elapsed:
            metrics["rollout_wait_fraction"] = self.recorder.rollout_wait_fraction(
                attempt.elapsed)
        evaluated = self.evaluations.result() if self.evaluations is not None else {}
        metrics.update(evaluated.pop("metrics", dict.fromkeys(("eval_return_mean",
                                                               "best_eval_return"))))
        return {
            "episodes": self.state.episodes_done,
            **({"stopped_by": self.stopped_by} if self.stopped_by else {}),
            **(self.checkpointer.figures() if self.checkpointer is not None else {}),
            "mean_return_last_window": round(recent, 2),
            "reached_target": reached_at is not None,
            "time_to_target_s": round(reached_at[0], 2) if reached_at else None,
            "env_steps_to_target": reached_at[1] if reached_at else None,
            **figures,
            **evaluated,
        }

    def _quantity(self) -> float:
        """What the target is compared with (``loop.stop_on``)."""
        if self.loop.stop_on == "eval" and self.evaluations is not None:
            return self.evaluations.latest_return
        return self.state.recent_return(self.loop.window)
