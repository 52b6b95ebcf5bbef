"""What one rank of a run is made of, as the plan assigns it (docs/how-a-rank-runs.md).

A rank gets a role per job it does: a :class:`~app.runtime.roles.collector.Collector` where it
steps environments, a :class:`~app.runtime.trainer.role.Trainer` where it trains (both on a
colocated trainer), a replay server where it holds the replay (app/runtime/replay/service.py),
and the decider's services where it takes the stop decision. What moves between ranks goes
through its hand-off (app/runtime/handoff/). :func:`build_rank` assembles them in the one order
they depend on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app.api import JobInfo
from app.runtime.checkpoints.agreement import run_settings
from app.runtime.checkpoints.checkpoint import CHECKPOINT_DIR
from app.runtime.checkpoints.checkpointer import Checkpointer
from app.runtime.checkpoints.replay_shards import ReplayShard
from app.runtime.core.algorithm import Algorithm
from app.runtime.core.seeds import env_seed
from app.runtime.core.segments import with_episodes
from app.runtime.core.state import RunState
from app.runtime.evaluation.evaluator import Evaluations
from app.runtime.handoff import HandOff, HandOffSettings, ReplayHooks, build_hand_off
from app.runtime.membership.replicas import form_replica_world
from app.runtime.membership.rollouts import EpochLeader, epoch_timeout
from app.runtime.membership.trainers import TrainerGroup
from app.runtime.replay.client import LocalReplay
from app.runtime.replay.offpolicy import OffPolicyAlgorithm
from app.runtime.replay.service import ReplayLink, collectors
from app.runtime.roles.collector import Collector
from app.runtime.rollout.worker import Agent, RolloutWorker, build_segment_format
from app.runtime.settings import RunSettings
from app.runtime.settings.builders import build_policy, cadence
from app.runtime.trainer.role import Trainer
from app.runtime.trainer.trained import TrainedModule
from rlcomm import CommContext, LayoutPlan, ParallelMode


@dataclass
class Rank:
    """One rank's parts. ``deciders``: the mode of the ranks that take the stop decision, if this
    rank is one of them (every rank, or the trainers of a run whose rollout ranks may leave and
    join); None where it follows its trainer."""

    loop: RunSettings
    ctx: CommContext
    job: JobInfo
    agent: Agent
    algorithm: Algorithm[Any]
    hand_off: HandOff
    replay_link: ReplayLink
    deciders: ParallelMode | None
    collector: Collector | None = None
    trainer: Trainer | None = None
    checkpointer: Checkpointer | None = None
    evaluations: Evaluations | None = None
    trainers: TrainerGroup | None = None  # where a lost trainer leaves the others going
    state: RunState = field(default_factory=RunState)
    # Measured seconds of this attempt: collecting (env stepping and the policy's forward split
    # out), the update, and communication (time_split_s in the result), which the roles add to.
    split_s: dict[str, float] = field(default_factory=dict)


def build_rank(loop: RunSettings, ctx: CommContext, job: JobInfo) -> Rank:
    """This rank's parts, built in the order they depend on: which ones, as the plan gives this
    rank its jobs; what kind, as the run's shape says (``job.shape``)."""
    plan, shape, rank = job.plan, job.shape, ctx.get_global_rank()
    trains = rank in plan.trainers
    collects = (plan.colocated and trains) or rank in plan.rollouts
    elastic = shape.elastic_rollouts
    if trains and job.joining and shape.replica_groups:
        form_replica_world(ctx, plan)  # its grid, with its replica group's other new ranks
    if loop.threads:  # else the launcher's: the node's cores over its ranks (app/launch/rank.py)
        torch.set_num_threads(loop.threads)
    torch.manual_seed(job.seed)  # same initial weights on every rank
    # As the launcher probed them (they travel with the loop); else one env, built and closed.
    spaces = loop.spaces
    algorithm = loop.build_algorithm(spaces)
    # What the rollouts act with, and what the weights carry: the policy (the algorithm's
    # module, or loop.model's) and the normalisers' statistics.
    agent = Agent(build_policy(loop, algorithm, spaces), spaces, loop.env,
                  context=loop.model.history)
    hparams = loop.hparams
    episode_cap = hparams.num_envs * (hparams.num_steps // 8 + 1)
    segment_format = build_segment_format(algorithm, spaces, agent, hparams.num_steps,
                                          hparams.num_envs)
    if elastic:  # a member's episodes travel in its segment
        segment_format = with_episodes(segment_format, episode_cap)
    split_s = dict.fromkeys(("collect", "env", "act", "update", "comm"), 0.0)
    collector = _collector(loop, job, rank, algorithm, agent, segment_format,
                          split_s) if collects else None
    # A sharded trainer's copy is made before the hand-off, which sends its shards; DDP wraps
    # the acting module itself, only once the hand-off bound it to its send buffer (the
    # parameters then live there).
    trained = TrainedModule(ctx, plan, agent.net, shape) if trains and shape.sharded else None
    replay_link = ReplayLink(ctx, plan, algorithm, segment_format, job.seed,
                             job.run_dir / CHECKPOINT_DIR, forwards=shape.forwards)
    settings = _hand_off_settings(loop, ctx, job, episode_cap)
    replay = ReplayHooks(write=replay_link.put if replay_link.target is not None else None,
                         served=replay_link.served if replay_link.server is not None else None)
    hand_off = build_hand_off(ctx, job, agent, replay_link.hand_off_format, trained, settings,
                              replay)
    deciders = None if elastic and not trains else (
        ParallelMode.TRAIN_DATA_PARALLEL if elastic else ParallelMode.GLOBAL)
    parts = Rank(loop, ctx, job, agent, algorithm, hand_off, replay_link, deciders,
                 collector=collector, state=RunState.for_window(loop.window), split_s=split_s)
    if trains and shape.elastic_trainers:
        parts.trainers = _trainer_group(parts, settings.timeout_s)
    if trains:
        trained = trained or TrainedModule(ctx, plan, agent.net, shape)
        parts.trainer = Trainer(ctx, plan, algorithm, agent, trained, job.seed, split_s)
        parts.checkpointer = Checkpointer(ctx, job.run_dir, cadence(loop), parts.trainer,
                                          run_settings(loop, spaces),
                                          replay=_checkpointed_replay(algorithm, plan),
                                          holder=(plan.trainers.index(rank), len(plan.trainers)),
                                          on_save=replay_link.save_shards)
    if loop.eval_every and deciders is not None:  # beside training, in the lead trainer's process
        parts.evaluations = Evaluations(loop, ctx, min(plan.trainers), deciders, job.run_dir)
    return parts


def _collector(loop: RunSettings, job: JobInfo, rank: int, algorithm: Algorithm, agent: Agent,
               segment_format: Any, split_s: dict[str, float]) -> Collector:
    """A collecting rank's worker, stepping its envs into segments of ``segment_format``."""
    worker = RolloutWorker(algorithm, loop.spaces, loop.env, agent,
                           seed=env_seed(job.seed, rank))
    worker.use_segment_format(segment_format)
    # Which collector it is, for per-collector exploration.
    plan = job.plan
    algorithm.set_collector(collectors(plan).index(rank), len(collectors(plan)))
    return Collector(worker, agent, split_s)


def _hand_off_settings(loop: RunSettings, ctx: CommContext, job: JobInfo,
                       episode_cap: int) -> HandOffSettings:
    return HandOffSettings(max_staleness=loop.max_staleness,
                           verify_every=loop.verify_weights_every,
                           min_rollouts=loop.min_rollouts,
                           timeout_s=ctx.timeout.total_seconds(), episode_cap=episode_cap,
                           sharded=job.shape.shards_weights,
                           rollout_restarts=job.rollout_restarts)


def _trainer_group(parts: Rank, timeout_s: float) -> TrainerGroup:
    """The trainers' own membership (app/runtime/trainer/), formed (or, joining, asked for):
    a lost trainer's rollout ranks go to this trainer's group of them."""
    membership, plan = parts.hand_off.membership, parts.job.plan
    assert isinstance(membership, EpochLeader), "elastic trainers lead their rollout ranks"
    group = TrainerGroup(parts.ctx, list(plan.trainers), dict(parts.job.hosts),
                         epoch_timeout(parts.ctx, timeout_s), membership.adopt,
                         joining=parts.job.joining,
                         holds=_own_replay_size(parts.algorithm, plan),
                         replicas=plan.replicas if parts.job.shape.replica_groups else ())
    group.begin()
    return group


def _checkpointed_replay(algorithm: Algorithm[Any], plan: LayoutPlan) -> ReplayShard | None:
    """A trainer's own replay shard, where ``loop.replay.checkpoint`` saves it with each
    checkpoint; None otherwise (on-policy, the option off, or replay ranks hold the replay)."""
    if not isinstance(algorithm, OffPolicyAlgorithm) or plan.replay:
        return None
    replay = algorithm.replay
    return replay if isinstance(replay, LocalReplay) and replay.settings.checkpoint else None


def _own_replay_size(algorithm: Algorithm[Any], plan: LayoutPlan) -> Callable[[], int] | None:
    """How many transitions an off-policy trainer's own replay shard holds (lost with it, and
    counted); None where it has none (on-policy, or replay ranks hold the replay)."""
    if not isinstance(algorithm, OffPolicyAlgorithm) or plan.replay:
        return None
    return lambda: int(algorithm.replay.size)
