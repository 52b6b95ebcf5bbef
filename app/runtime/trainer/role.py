"""The trainer role: a rank that updates the policy on the segments handed to it."""

from __future__ import annotations

import time
from typing import Any

import torch

from app.runtime.core.algorithm import Algorithm, Peers, Segment, UpdateInfo
from app.runtime.core.seeds import minibatch_seed
from app.runtime.core.state import RunState
from app.runtime.rollout.worker import Agent
from app.runtime.trainer.gradients import AveragedGradients
from app.runtime.trainer.trained import (
    TrainedModule,
    TrainerGrid,
    replica_rank,
    share_replica_segments,
)
from rlcomm import CommContext, LayoutPlan, ParallelMode, collectives

TDP = ParallelMode.TRAIN_DATA_PARALLEL


class Trainer:
    """Folds what the collectors observed into the normalisers' statistics, shares its segments
    within its TENSOR x SEQUENCE block, and runs the algorithm's update on ``trained`` (what
    this rank trains: docs/sharding.md). ``split_s``: the rank's time split, which it adds its
    ``update`` and ``comm`` seconds to."""

    def __init__(self, ctx: CommContext, plan: LayoutPlan, algorithm: Algorithm[Any],
                 agent: Agent, trained: TrainedModule, seed: int,
                 split_s: dict[str, float]) -> None:
        self.ctx, self.algorithm, self.agent, self.trained = ctx, algorithm, agent, trained
        self.optimizer = algorithm.optimizer(trained.trained)
        # Elastic trainers (app/runtime/trainer/): averaged over the live ones (sharded ones in
        # replica groups: by their FSDP units, app/runtime/trainer/trained.py).
        self.averaged = AveragedGradients(ctx, self.optimizer) \
            if trained.shape.elastic_trainers and not trained.sharded else None
        self.peers = TrainerPeers(ctx) if len(plan.trainers) > 1 else Peers()
        self.count = len(plan.trainers)
        self.grid = TrainerGrid.of(plan)
        # The ranks of one block train one replica on the same batch, in the same minibatch
        # order: they seed it from the block's first rank.
        self.replica_rank = replica_rank(plan, ctx.get_global_rank())
        self.seed, self.split_s = seed, split_s
        self.generator = torch.Generator()

    def train(self, segments: list[Segment], state: RunState) -> dict[str, float]:
        """One update on ``segments`` (this rank's share of the job's); the losses it returns."""
        lag = max((s.lag for s in segments), default=0)  # the version lag trained on
        tick = time.perf_counter()
        self._fold_moments(segments)  # each segment's moments once, before they are shared
        if self.grid.replica_size > 1:
            segments = share_replica_segments(self.ctx, self.grid, segments)
            lag = max(s.lag for s in segments)
        self.split_s["comm"] += time.perf_counter() - tick
        # Minibatch order is a function of (seed, replica, update): a resumed run shuffles as
        # the uninterrupted one would, with no generator state to carry.
        self.generator.manual_seed(minibatch_seed(self.seed, self.replica_rank, state.update))
        info = UpdateInfo(self.optimizer, self.generator, state.env_steps, state.update, lag,
                          self.peers)
        tick = time.perf_counter()
        losses = self.algorithm.update(self.trained.model, self.agent.net, segments, info)
        self.trained.publish()  # a sharded trainer's new weights, whole, into the agent
        self.split_s["update"] += time.perf_counter() - tick
        return losses

    def _fold_moments(self, segments: list[Segment]) -> None:
        """Every trainer folds the moments alike (summed over TRAIN_DATA_PARALLEL), so the
        next weights carry identical statistics."""
        norms = {"obs_moments": self.agent.obs_norm, "return_moments": self.agent.reward_norm}
        for key, norm in norms.items():
            if norm is None:
                continue
            parts = [s.moments[key] for s in segments]
            combined = parts[0].clone()
            for part in parts[1:]:
                combined = norm.combine(combined, part)
            everyone = collectives.all_gather(self.ctx, ParallelMode.TRAIN_DATA_PARALLEL,
                                              combined.unsqueeze(0))
            for moments in everyone:  # the same order on every trainer: identical statistics
                norm.merge(moments)


class TrainerPeers(Peers):
    """The live trainers, over TRAIN_DATA_PARALLEL (the planned trainers, or elastic trainers'
    current epoch)."""

    def __init__(self, ctx: CommContext) -> None:
        self.ctx = ctx

    def size(self) -> int:
        return self.ctx.get_world_size(TDP)

    def fewest(self, count: int) -> int:
        fewest = torch.tensor([count], dtype=torch.int64)
        return int(collectives.all_reduce(self.ctx, TDP, fewest, torch.distributed.ReduceOp.MIN))

    def average(self, tensor: torch.Tensor) -> None:
        collectives.all_reduce(self.ctx, TDP, tensor)
        tensor.div_(self.size())
