"""Evaluation beside training (``loop.eval_every``): the lead trainer hands a copy of the weights
it just made, the same whole weights the hand-off sends to rollout ranks, to a background
process, which runs ``loop.eval_episodes`` whole episodes with the deterministic action on fresh
environments (app/runtime/evaluation/episodes.py) while training goes on.

The process is spawned once per run, niced below the ranks (evaluation yields the CPU to
training), and ends when its pipe closes: when the rank ends, however it ends. One evaluation
runs at a time; a due one that finds the previous still running is skipped and counted.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from app.api import ConfigError
from app.runtime.checkpoints.checkpoint import (
    CHECKPOINT_DIR,
    WholeCheckpoint,
    load_checkpoint,
    save_checkpoint,
)
from app.runtime.evaluation.video import headless
from rlcomm import CommContext, ParallelMode, collectives

if TYPE_CHECKING:
    from app.runtime.settings import RunSettings

BEST = "best"  # checkpoints/best: the weights of the best evaluation so far
VIDEOS = "videos"  # loop.eval_video: videos/best.mp4 and videos/last.mp4
EVAL_COLUMNS = ("eval_return_mean", "eval_return_std", "eval_length_mean", "eval_version",
                "eval_env_steps")
_NICE = 10  # below the ranks: an evaluation must not slow the update it runs beside


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of the weights of ``version`` (made by update ``update``, after
    ``env_steps`` env steps)."""

    version: int
    update: int
    env_steps: int
    return_mean: float
    return_std: float
    length_mean: float

    def row(self) -> dict[str, float]:
        """Its columns in the metrics row of the update it arrived in."""
        values = (self.return_mean, self.return_std, self.length_mean, self.version,
                  self.env_steps)
        return {name: float(value) for name, value in zip(EVAL_COLUMNS, values)}

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.version, self.update, self.env_steps, self.return_mean,
                             self.return_std, self.length_mean], dtype=torch.float64)

    @staticmethod
    def from_tensor(values: torch.Tensor) -> Evaluation | None:
        """The inverse of :meth:`as_tensor`; None for a tensor of NaNs (nothing arrived)."""
        if math.isnan(float(values[0])):
            return None
        version, update, steps, mean, std, length = values.tolist()
        return Evaluation(int(version), int(update), int(steps), mean, std, length)


def evaluation_row(arrived: Evaluation | None) -> dict[str, float]:
    """The evaluation columns of an update's metrics row: NaN when none arrived in it."""
    return arrived.row() if arrived is not None else dict.fromkeys(EVAL_COLUMNS, float("nan"))


class BackgroundEvaluator:
    """The lead trainer's evaluation process."""

    def __init__(self, loop: RunSettings) -> None:
        context = multiprocessing.get_context("spawn")  # nothing of the rank's (gloo, threads)
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(loop, child), daemon=True,
                                         name="evaluator")
        self._process.start()
        child.close()
        self._running: tuple[int, int, int] | None = None  # version, update, env steps
        self.skipped = 0

    @property
    def busy(self) -> bool:
        return self._running is not None

    def submit(self, version: int, update: int, env_steps: int,
               weights: dict[str, torch.Tensor], video: Path | None = None) -> bool:
        """Starts evaluating ``weights`` (policy and normalisers, copied), recording the first
        episode as ``video`` if given; False when the previous evaluation still runs (this one
        is skipped)."""
        if self.busy:
            self.skipped += 1
            return False
        self._conn.send(({k: v.detach().clone() for k, v in weights.items()}, video))
        self._running = (version, update, env_steps)
        return True

    def poll(self, timeout_s: float = 0.0) -> Evaluation | None:
        """The finished evaluation, if one finished (waiting up to ``timeout_s``)."""
        if self._running is None or not self._conn.poll(timeout_s):
            return None
        message = self._conn.recv()
        if isinstance(message, str):
            raise RuntimeError(f"the evaluation process failed: {message}")
        version, update, env_steps = self._running
        self._running = None
        return Evaluation(version, update, env_steps, *message)

    def close(self) -> None:
        """Ends the process (an evaluation still running is dropped)."""
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _serve(loop: RunSettings, conn: Connection) -> None:
    """The evaluation process: builds the policy once, then evaluates each weights it is sent
    until the pipe closes."""
    from app.runtime.evaluation.episodes import run_episodes
    from app.runtime.rollout.worker import Agent
    from app.runtime.settings.builders import build_policy

    os.nice(_NICE)
    torch.set_num_threads(1)
    headless()
    algorithm = loop.build_algorithm(loop.spaces)
    agent = Agent(build_policy(loop, algorithm, loop.spaces), loop.spaces, loop.env,
                  context=loop.model.history)
    while True:
        try:
            weights, video = conn.recv()
        except (EOFError, OSError):  # the rank ended
            return
        try:
            agent.load_state_dict(weights)
            done = run_episodes(algorithm, agent, loop.env, loop.eval_episodes, loop.eval_seed,
                                videos=[video] if video is not None else [])
            reply: Any = (done.mean_return, done.std_return, done.mean_length)
        except Exception as err:  # the rank raises it, named
            reply = f"{type(err).__name__}: {err}"
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


class Evaluations:
    """A run's evaluations: the lead trainer's process, what it found, shared with every rank
    that takes the stop decision (``over``) at the same update, and ``checkpoints/best``.

    ``best_record``: what the lead trainer writes as ``checkpoints/best`` (taken when the
    weights were handed over) if their evaluation is the best so far; None where trainers are
    sharded (no best is kept)."""

    def __init__(self, loop: RunSettings, ctx: CommContext, lead: int, over: ParallelMode,
                 run_dir: Path) -> None:
        self.ctx, self.lead, self.over = ctx, lead, over
        self.run_dir, self.video = run_dir, loop.eval_video
        self._video: Path | None = None  # the running evaluation's first episode
        self.process = BackgroundEvaluator(loop) if ctx.get_global_rank() == lead else None
        # What arrived, kept bounded: the last, the best and how many.
        self.last: Evaluation | None = None
        self.best_seen: Evaluation | None = None
        self.count = 0
        self.best_path: Path | None = None
        self._best_return: float | None = None  # read from checkpoints/best on first need
        self._best: Evaluation | None = None
        self._record: WholeCheckpoint | None = None  # checkpoints/best's, should it be

    def share(self) -> Evaluation | None:
        """The evaluation that finished since the last call (on every rank of ``over``,
        alike), or None."""
        found = self.process.poll() if self.process is not None else None
        values = (found.as_tensor() if found is not None
                  else torch.full((6,), float("nan"), dtype=torch.float64))
        collectives.broadcast(self.ctx, self.over, values, src=self.lead)
        arrived = Evaluation.from_tensor(values)
        if arrived is not None:
            self._arrived(arrived)
            if self.process is not None:
                self._keep(arrived)
        return arrived

    def submit(self, version: int, update: int, env_steps: int, weights: dict[str, Tensor],
               best_record: WholeCheckpoint | None) -> None:
        """The lead trainer hands ``weights`` over, if the previous evaluation is done."""
        video = self.run_dir / VIDEOS / f"eval-v{version}.mp4" if self.video else None
        if self.process is not None and self.process.submit(version, update, env_steps,
                                                            weights, video):
            self._record, self._video = best_record, video

    @property
    def latest_return(self) -> float:
        """The last evaluation's mean return (-inf before the first): ``loop.stop_on=eval``."""
        return self.last.return_mean if self.last is not None else float("-inf")

    def finish(self, timeout_s: float) -> None:
        """The lead trainer waits for an evaluation still running, then ends the process."""
        if self.process is None:
            return
        try:
            last = self.process.poll(timeout_s) if self.process.busy else None
            if last is not None:
                self._arrived(last)
                self._keep(last)
        finally:
            self.process.close()

    def close(self) -> None:
        if self.process is not None:
            self.process.close()

    def result(self) -> dict[str, Any]:
        """Its part of result.json (the figures, for a sweep to rank by, under ``metrics``)."""
        last, best = self.last, self.best_seen
        out: dict[str, Any] = {
            "evaluations": self.count,
            "eval": asdict(last) if last else None,
            "best_eval": asdict(best) if best else None,
            "metrics": {"eval_return_mean": round(last.return_mean, 2) if last else None,
                        "best_eval_return": round(best.return_mean, 2) if best else None},
        }
        if self.process is not None:
            out["evaluations_skipped"] = self.process.skipped
            out["best_checkpoint"] = (
                {"path": str(self.best_path), **asdict(self._best)}
                if self.best_path and self._best else None)
        return out

    def _arrived(self, evaluation: Evaluation) -> None:
        self.last, self.count = evaluation, self.count + 1
        if self.best_seen is None or evaluation.return_mean > self.best_seen.return_mean:
            self.best_seen = evaluation

    def _keep(self, evaluation: Evaluation) -> None:
        """The lead trainer keeps what an arrived evaluation left: the best checkpoint and
        video when it is the best so far, and its video as the last."""
        record, self._record = self._record, None
        video, self._video = self._video, None
        if self._best_return is None:
            self._best_return = _best_so_far(self.run_dir / CHECKPOINT_DIR / BEST)
        best = evaluation.return_mean > self._best_return
        if best:
            self._best_return = evaluation.return_mean
        if best and record is not None:
            self.best_path = save_checkpoint(self.run_dir, record.policy, record.optimizer,
                                             record.state, name=BEST,
                                             extra={"eval": asdict(evaluation)})
            self._best = evaluation
        if video is not None and video.exists():
            if best:
                shutil.copyfile(video, video.with_name(".best.partial.mp4"))
                os.replace(video.with_name(".best.partial.mp4"), video.with_name("best.mp4"))
            os.replace(video, video.with_name("last.mp4"))


def _best_so_far(path: Path) -> float:
    """The evaluated return of the run's ``checkpoints/best`` (an earlier attempt's), so that a
    resumed run replaces it only with a better one; -inf when there is none."""
    if not path.exists():
        return float("-inf")
    try:
        return float(load_checkpoint(path).get("eval", {}).get("return_mean", float("inf")))
    except ConfigError:  # unreadable: kept, never replaced by this attempt
        return float("inf")
