"""The Checkpointer: a trainer's checkpoints, by the run's cadence, written in the background and
retired by its retention, flat or sharded (DCP), and what ``checkpoints/best`` would hold; and a
run's resume, picked and verified (:func:`~app.runtime.checkpoints.checkpoint.resume_source`),
applied to a rank."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from app.api import JobInfo
from app.output.logs import FILE_ONLY
from app.runtime.checkpoints.cadence import Cadence
from app.runtime.checkpoints.checkpoint import (
    CHECKPOINT_DIR,
    Resumable,
    TrainingState,
    WholeCheckpoint,
    checkpoint_content,
    checkpoint_path,
    resume_source,
    snapshot,
    write_checkpoint,
)
from app.runtime.checkpoints.replay_shards import (
    ReplayShard,
    dealt_shards,
    shard_path,
    write_shard,
)
from app.runtime.checkpoints.retention import is_milestone, keep_as_milestone, retire
from app.runtime.checkpoints.shards import (
    finish_sharded_checkpoint,
    load_sharded_checkpoint,
    stage_sharded_checkpoint,
)
from app.runtime.checkpoints.writes import BackgroundWrites
from app.runtime.core.algorithm import Algorithm
from app.runtime.core.state import RunState
from app.runtime.rollout.worker import Agent
from app.runtime.trainer.trained import TrainedModule
from rlcomm import CommContext, ParallelMode

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)


class Checkpointed(Protocol):
    """What a checkpoint holds of a trainer (the trainer role: app/runtime/trainer/role.py):
    the module it trains and its optimizer, the agent it acts with (the normalisers'
    statistics) and the algorithm's own state."""

    trained: TrainedModule
    optimizer: torch.optim.Optimizer
    agent: Agent
    algorithm: Algorithm[Any]


class Checkpointer:
    """Writes ``checkpoints/ckpt_<update>`` when the ``cadence`` says (and at the end): under
    DDP rank 0 writes the whole state every trainer gathered, sharded trainers each write their
    own shards (app/runtime/checkpoints/shards.py). A flat checkpoint is a snapshot taken
    between two updates and written in the background (app/runtime/checkpoints/writes.py);
    once it is durable, checkpoints beyond the cadence's ``keep`` are removed
    (app/runtime/checkpoints/retention.py). ``settings``: what a checkpoint records of the run's
    (:func:`~app.runtime.checkpoints.agreement.run_settings`). An elastic run's checkpoint
    keeps its membership epoch, which its metrics rows carry."""

    def __init__(self, ctx: CommContext, run_dir: Path, cadence: Cadence, trainer: Checkpointed,
                 settings: dict[str, Any], replay: ReplayShard | None = None,
                 holder: tuple[int, int] = (0, 1),
                 on_save: Callable[[int], None] | None = None) -> None:
        self.ctx, self.run_dir, self.cadence = ctx, run_dir, cadence
        self.trainer, self.settings = trainer, settings
        # loop.replay.checkpoint: this trainer's replay shard, holder ``holder[0]`` of
        # ``holder[1]`` (app/runtime/checkpoints/replay_shards.py).
        self.replay, self.holder = replay, holder
        # Told the update of each checkpoint rank 0 writes (the replay ranks' shards beside it).
        self.on_save = on_save
        self.writes = BackgroundWrites()
        self.snapshot_s = 0.0  # the update loop's time taking snapshots
        # The last checkpoint's (update, seconds trained): the cadence counts from it.
        self.last: tuple[int, float] | None = None
        self._first = True  # this process's first write clears stale *.tmp files
        self._group: ProcessGroup | None = None  # sharded checkpoints' own (_sharded_group)

    def due(self, state: RunState) -> bool:
        """Whether this trainer finds a checkpoint due now (the trainers agree on it: the
        Decider's records)."""
        return self.cadence.on and self.cadence.due(state.update, state.training_s(), self.last)

    def resumed_at(self, update: int, trained_s: float) -> None:
        """The run resumed from a checkpoint of ``update``: the cadence counts from it."""
        self.last = (update, trained_s)

    def check(self) -> None:
        """Raises the error of a background write that failed (every update)."""
        self.writes.check()

    def save(self, state: RunState, history: Mapping[str, Any],
             sync: Callable[[], None]) -> None:
        """The run's state as of now, written in the background; every trainer calls it.
        ``history``: where the history files stand (the Recorder's mark); ``sync``: makes
        them durable first, so the checkpoint never records rows the disk does not hold."""
        tick = time.perf_counter()
        trained, optimizer = self.trainer.trained, self.trainer.optimizer
        training = self._training_state(state, history)
        now = (state.update, training.train_s)
        milestone = is_milestone(self.last, now, self.cadence.milestone_every,
                                 self.cadence.milestone_every_s)
        self.last = now
        if trained.sharded:  # each trainer writes its own shards, together
            if trained.writes_checkpoints:
                self._save_sharded(training, milestone, sync, tick)
            return
        policy, optimizer_state = trained.state_dicts(optimizer)  # every trainer takes part
        shard = self.replay.contents() if self.replay is not None else None
        writes = self.ctx.get_global_rank() == 0
        content = snapshot(policy, optimizer_state, training) if writes else None
        if writes and self.on_save is not None:
            self.on_save(state.update)
        taken_s = time.perf_counter() - tick
        self.snapshot_s += taken_s
        if content is None and shard is None:
            return
        final = checkpoint_path(self.run_dir, state.update)
        clear, self._first = self._first, False
        waited_before = self.writes.waited_s
        self.writes.settle()  # at most one write in flight
        waited_s = self.writes.waited_s - waited_before

        def write() -> None:
            started = time.perf_counter()
            if shard is not None:  # before the checkpoint: a resume finds its shards with it
                write_shard(shard_path(final.parent, state.update, self.holder[0]), shard,
                            self.holder[1])
            if content is not None:
                sync()
                self._retire(write_checkpoint(final, content, clear_stale=clear), milestone)
                _log_costs(final, taken_s, waited_s, time.perf_counter() - started)

        self.writes.submit(write, final.name)

    def _save_sharded(self, training: TrainingState, milestone: bool,
                      sync: Callable[[], None], tick: float) -> None:
        """Every trainer stages its shards now (DCP's async_save) and completes the folder in
        the background, over a process group of the checkpoints' own: their collectives run
        beside training's."""
        waited_before = self.writes.waited_s
        self.writes.settle()  # the group carries one checkpoint at a time
        waited_s = self.writes.waited_s - waited_before
        trained = self.trainer.trained
        clear, self._first = self._first, False
        staged = stage_sharded_checkpoint(self.run_dir, trained, self.trainer.optimizer,
                                          self._sharded_group(), training, clear_stale=clear)
        taken_s = time.perf_counter() - tick - waited_s
        self.snapshot_s += taken_s
        if staged is None:
            return

        def write() -> None:
            started = time.perf_counter()
            sync()
            folder = finish_sharded_checkpoint(staged)
            if folder is not None:
                self._retire(folder, milestone)
                _log_costs(folder, taken_s, waited_s, time.perf_counter() - started)

        self.writes.submit(write, staged.final.name)

    def _sharded_group(self) -> ProcessGroup:
        """The sharded checkpoint's trainers, as a gloo group of the checkpoints' own."""
        if self._group is None:
            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(self.trainer.trained.checkpoint_group(self.ctx))
            self._group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return self._group

    def save_final(self, state: RunState, history: Mapping[str, Any],
                   sync: Callable[[], None]) -> None:
        """The final state too, unless the last update's checkpoint holds it; then every write
        is waited for (a failed one raised)."""
        if self.cadence.on and (self.last is None or self.last[0] != state.update):
            self.save(state, history, sync)
        self.wait()

    def wait(self) -> None:
        """Until the write in flight is durable; raises its error."""
        self.writes.wait()

    def figures(self) -> dict[str, float]:
        """What checkpoints cost this trainer's update loop (result.json)."""
        return {**self.writes.figures(), "checkpoint_snapshot_s": round(self.snapshot_s, 4)}

    def best(self, state: RunState) -> WholeCheckpoint | None:
        """What ``checkpoints/best`` would hold if the weights just sent evaluate best (copies);
        None for sharded trainers, which keep no best."""
        if self.trainer.trained.sharded:
            return None
        policy = {k: v.clone() for k, v in self.trainer.agent.net.state_dict().items()}
        optimizer = copy.deepcopy(self.trainer.optimizer.state_dict())
        return WholeCheckpoint(policy, optimizer, self._training_state(state, {}))

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
        if self.replay is not None:
            held = dealt_shards(picked.path, int(picked.state["update"]), *self.holder)
            self.replay.restore(held)
            log.info("restored %d replay transitions from %d shard(s) of %s",
                     sum(int(h["priorities"].numel()) for h in held), len(held),
                     picked.path.name)

    def content(self, state: RunState) -> dict[str, Any]:
        """This flat trainer's whole state as a checkpoint holds it, with its checksum: what a
        joining trainer heals from."""
        policy, optimizer = self.trainer.trained.state_dicts(self.trainer.optimizer)
        return checkpoint_content(policy, optimizer, self._training_state(state, {}))

    def load_content(self, content: Mapping[str, Any]) -> None:
        """A flat checkpoint's policy, optimizer and algorithm state into this trainer."""
        self.trainer.trained.load(content["policy"], content["optimizer"], self.trainer.optimizer)
        if "algorithm" in content:
            self.trainer.algorithm.load_state_dict(content["algorithm"])

    def _retire(self, written: Path, milestone: bool) -> None:
        """After ``written`` is durable: kept as a milestone if it is one, and the checkpoints
        beyond the cadence's ``keep`` removed."""
        if milestone:
            keep_as_milestone(written)
        retire(self.run_dir / CHECKPOINT_DIR, self.cadence.keep)

    def _training_state(self, state: RunState, history: Mapping[str, Any]) -> TrainingState:
        agent: Agent = self.trainer.agent
        algorithm: Algorithm[Any] = self.trainer.algorithm
        return TrainingState(
            update=state.update, env_steps=state.env_steps, episodes=list(state.recent),
            episodes_done=state.episodes_done, history=history, settings=self.settings,
            normalizers={k: v.clone() for k, v in agent.normalizers().items()},
            epoch=state.epoch,
            # An off-policy algorithm's own state (never a sharded trainer's).
            algorithm=copy.deepcopy(algorithm.state_dict()),
            train_s=state.training_s(), reached_at=state.reached_at)


def _log_costs(written: Path, snapshot_s: float, waited_s: float, write_s: float) -> None:
    """One checkpoint's size and what it cost, in the rank's log (benchmarks/long_run.py reads
    them): the update loop's time taking the snapshot and waiting for the previous write, and
    the background write's own time."""
    size = (sum(p.stat().st_size for p in written.rglob("*") if p.is_file())
            if written.is_dir() else written.stat().st_size)
    log.info("checkpoint %s: %d bytes; the update loop took %.2f ms for its snapshot and "
             "waited %.2f ms for the previous write; written in %.1f ms", written.name, size,
             1e3 * snapshot_s, 1e3 * waited_s, 1e3 * write_s, extra=FILE_ONLY)


def resume(ctx: CommContext, job: JobInfo, source: str | None, over: ParallelMode,
           checkpointer: Checkpointer | None, agent: Agent,
           state: RunState) -> Resumable | None:
    """The checkpoint a deciding rank resumes from (after a restart this run's newest, else
    ``loop.resume``'s: ``source``), picked alike on every rank of ``over`` and verified, into
    this rank: a trainer's modules through its ``checkpointer``, a rollout rank's policy, and
    on every rank the counters, last episodes, normalisers' statistics, membership epoch and
    RNG. When it is this run's own (a restart: :func:`is_own`), the run's history goes on from
    it: the seconds trained and the first time the target was reached carry over (and its
    ``history`` says where the history files go on from). Returns the checkpoint picked, if
    any."""
    picked = resume_source(ctx, job, source, over)
    if picked is None:
        return None
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
    if is_own(picked, job):
        restore_history(saved, state)
    if checkpointer is not None:  # the cadence counts from the checkpoint
        checkpointer.resumed_at(state.update, state.train_s_before)
    return picked


def is_own(picked: Resumable, job: JobInfo) -> bool:
    """Whether ``picked`` is this run's own checkpoint (a restart), not another run's."""
    return picked.path.resolve().is_relative_to(job.run_dir.resolve())


def restore_counters(saved: Mapping[str, Any], agent: Agent, state: RunState) -> None:
    """A checkpoint's normalisers' statistics, counters, last episodes and RNG into this rank."""
    for name, value in saved.get("normalizers", {}).items():
        agent.state_dict()[name].copy_(value)  # in place: the tensors are bound
    state.update, state.env_steps = saved["update"], saved["env_steps"]
    episodes = [(float(r), int(n)) for r, n in saved["episodes"]]
    # A checkpoint written before format 4 held every episode of the run.
    state.restore_episodes(episodes, int(saved.get("episodes_done", len(episodes))))
    torch.set_rng_state(saved["torch_rng"])


def restore_history(saved: Mapping[str, Any], state: RunState) -> None:
    """The run's history as of a checkpoint: the seconds trained, and when and at how many
    env steps the target was first reached."""
    state.train_s_before = float(saved.get("train_s", 0.0))
    reached = saved.get("reached_at")
    state.reached_at = (float(reached[0]), int(reached[1])) if reached is not None else None


def note_resume(ctx: CommContext, job: JobInfo, source: str | None) -> Resumable | None:
    """A rank that follows its trainer: where the run resumed, if it did, by this rank's own
    restart count (a joiner replaces a lost rank of the running job: none). Its trainer's
    weights and statistics come with the first transfer."""
    if job.joining:
        return None
    picked = resume_source(ctx, job, source, over=None)
    if picked is not None:
        log.info("resumed from %s at update %d (%d env steps)", picked.path,
                 picked.state["update"], picked.state["env_steps"])
    return picked
