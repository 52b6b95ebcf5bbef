"""The Checkpointer: a trainer's checkpoints, written and read, flat or sharded (DCP), and what
``checkpoints/best`` would hold; and a run's resume, picked and verified
(:func:`~app.runtime.checkpoints.checkpoint.resume_source`), applied to a rank."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from app.api import JobInfo
from app.runtime.algorithm import Algorithm
from app.runtime.checkpoints.checkpoint import (
    Resumable,
    TrainingState,
    WholeCheckpoint,
    checkpoint_content,
    resume_source,
    save_checkpoint,
)
from app.runtime.checkpoints.shards import load_sharded_checkpoint, save_sharded_checkpoint
from app.runtime.roles.trainer import Trainer
from app.runtime.state import RunState
from app.runtime.worker import Agent
from rlcomm import CommContext, ParallelMode

log = logging.getLogger(__name__)


class Checkpointer:
    """Writes ``checkpoints/ckpt_<update>`` every ``every`` updates and at the end (0: never):
    under DDP rank 0 writes the whole state every trainer gathered, sharded trainers each write
    their own shards (app/runtime/checkpoints/shards.py). ``settings``: what a checkpoint
    records of the run's (:func:`~app.runtime.checkpoints.checkpoint.run_settings`). An elastic
    run's checkpoint keeps its membership epoch, which its metrics rows carry."""

    def __init__(self, ctx: CommContext, run_dir: Path, every: int, trainer: Trainer,
                 settings: dict[str, Any]) -> None:
        self.ctx, self.run_dir, self.every = ctx, run_dir, every
        self.trainer, self.settings = trainer, settings

    def due(self, update: int) -> bool:
        return bool(self.every) and update % self.every == 0

    def save(self, state: RunState, rows: list[dict[str, float]]) -> None:
        """The run's state as of now; every trainer calls it."""
        trained, optimizer = self.trainer.trained, self.trainer.optimizer
        training = self._training_state(state, rows)
        if trained.sharded:  # each trainer writes its own shards
            if trained.writes_checkpoints:
                save_sharded_checkpoint(self.run_dir, trained, optimizer,
                                        trained.checkpoint_group(self.ctx), training)
            return
        policy, optimizer_state = trained.state_dicts(optimizer)  # every trainer takes part
        if self.ctx.get_global_rank() == 0:
            save_checkpoint(self.run_dir, policy, optimizer_state, training)

    def save_final(self, state: RunState, rows: list[dict[str, float]]) -> None:
        """The final state too, unless the last update's checkpoint holds it."""
        if self.every and not self.due(state.update):
            self.save(state, rows)

    def best(self, state: RunState, rows: list[dict[str, float]]) -> WholeCheckpoint | None:
        """What ``checkpoints/best`` would hold if the weights just sent evaluate best (copies);
        None for sharded trainers, which keep no best."""
        if self.trainer.trained.sharded:
            return None
        policy = {k: v.clone() for k, v in self.trainer.agent.net.state_dict().items()}
        optimizer = copy.deepcopy(self.trainer.optimizer.state_dict())
        return WholeCheckpoint(policy, optimizer, self._training_state(state, rows))

    def load(self, picked: Resumable) -> None:
        """The picked checkpoint's policy, optimizer and algorithm state into this trainer;
        a sharded one is resharded into this grid (every trainer calls it)."""
        trained, optimizer = self.trainer.trained, self.trainer.optimizer
        if picked.sharded:  # an unsharded trainer reads whole tensors, on its own
            group = trained.checkpoint_group(self.ctx) if trained.sharded else None
            load_sharded_checkpoint(picked.path, trained, optimizer, group)
            if "algorithm" in picked.state:
                self.trainer.algorithm.load_state_dict(picked.state["algorithm"])
        else:
            self.load_content(picked.state)

    def content(self, state: RunState) -> dict[str, Any]:
        """This flat trainer's whole state as a checkpoint holds it (without the metrics
        rows), with its checksum: what a joining trainer heals from."""
        policy, optimizer = self.trainer.trained.state_dicts(self.trainer.optimizer)
        return checkpoint_content(policy, optimizer, self._training_state(state, []))

    def load_content(self, content: Mapping[str, Any]) -> None:
        """A flat checkpoint's policy, optimizer and algorithm state into this trainer."""
        self.trainer.trained.load(content["policy"], content["optimizer"], self.trainer.optimizer)
        if "algorithm" in content:
            self.trainer.algorithm.load_state_dict(content["algorithm"])

    def _training_state(self, state: RunState, rows: list[dict[str, float]]) -> TrainingState:
        agent: Agent = self.trainer.agent
        algorithm: Algorithm[Any] = self.trainer.algorithm
        return TrainingState(
            update=state.update, env_steps=state.env_steps, episodes=list(state.episodes),
            metrics=list(rows), settings=self.settings,
            normalizers={k: v.clone() for k, v in agent.normalizers().items()},
            epoch=int(rows[-1]["epoch"]) if rows and "epoch" in rows[-1] else None,
            # An off-policy algorithm's own state (never a sharded trainer's).
            algorithm=copy.deepcopy(algorithm.state_dict()),
            train_s=state.training_s(), reached_at=state.reached_at)


def resume(ctx: CommContext, job: JobInfo, source: str | None, over: ParallelMode,
           checkpointer: Checkpointer | None, agent: Agent,
           state: RunState) -> list[dict[str, float]]:
    """The checkpoint a deciding rank resumes from (after a restart this run's newest, else
    ``loop.resume``'s: ``source``), picked alike on every rank of ``over`` and verified, into
    this rank: a trainer's modules through its ``checkpointer``, a rollout rank's policy, and
    on every rank the counters, episodes, normalisers' statistics, membership epoch and RNG.
    When it is this run's own (a restart), the run's history goes on from it: its metrics rows
    are returned (metrics.csv keeps every update once), and the seconds trained and the first
    time the target was reached carry over."""
    picked = resume_source(ctx, job, source, over)
    if picked is None:
        return []
    if checkpointer is not None:
        checkpointer.load(picked)
    elif not picked.sharded:  # a rollout rank: a sharded one's weights come with the first
        agent.net.load_state_dict(picked.state["policy"])  # transfer, as they do anyway
    saved = picked.state
    restore_counters(saved, agent, state)
    state.resumed_from = picked.path
    if saved.get("epoch") is not None:  # a new epoch from whoever is there
        state.epoch_base = int(saved["epoch"]) + 1
    log.info("resumed from %s at update %d (%d env steps)", picked.path, state.update,
             state.env_steps)
    if not picked.path.resolve().is_relative_to(job.run_dir.resolve()):
        return []
    restore_history(saved, state)
    return list(saved["metrics"])


def restore_counters(saved: Mapping[str, Any], agent: Agent, state: RunState) -> None:
    """A checkpoint's normalisers' statistics, counters, episodes and RNG into this rank."""
    for name, value in saved.get("normalizers", {}).items():
        agent.state_dict()[name].copy_(value)  # in place: the tensors are bound
    state.update, state.env_steps = saved["update"], saved["env_steps"]
    state.episodes = [(float(r), int(n)) for r, n in saved["episodes"]]
    torch.set_rng_state(saved["torch_rng"])


def restore_history(saved: Mapping[str, Any], state: RunState) -> None:
    """The run's history as of a checkpoint: the seconds trained, and when and at how many
    env steps the target was first reached."""
    state.train_s_before = float(saved.get("train_s", 0.0))
    reached = saved.get("reached_at")
    state.reached_at = (float(reached[0]), int(reached[1])) if reached is not None else None


def note_resume(ctx: CommContext, job: JobInfo, source: str | None) -> None:
    """A rank that follows its trainer: where the run resumed, if it did, by this rank's own
    restart count (a joiner replaces a lost rank of the running job: none). Its trainer's
    weights and statistics come with the first transfer."""
    if job.joining:
        return
    picked = resume_source(ctx, job, source, over=None)
    if picked is not None:
        log.info("resumed from %s at update %d (%d env steps)", picked.path,
                 picked.state["update"], picked.state["env_steps"])
