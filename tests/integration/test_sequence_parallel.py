"""Sequence (context) parallel trainers (app/runtime/trainer/trained.py, the transformer's
``context_parallel``): the window split over SEQUENCE_PARALLEL trains as DDP does, alone, under
FSDP and with tensor parallelism (under DDP and FSDP), to float precision; and a gather that
drops the gradient other chunks send back is caught."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from app.loops.ppo.core import PPO, PPOSettings
from app.runtime import Segment, UpdateInfo
from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.models.transformer import TransformerActorCritic
from app.runtime.rollout.worker import Agent, RolloutWorker, as_segment
from app.runtime.trainer.trained import (
    TrainedModule,
    TrainerGrid,
    replica_rank,
    share_replica_segments,
)
from rlcomm import LayoutSpec, plan_layout
from rlcomm.testing import planned_context, run_ranks
from tests.helpers.parity import TOLERANCE, largest_gap, mean_losses
from tests.helpers.shapes import shape_of

UPDATES = 20
DISTINCT = 5  # segments per collector, trained on in turn: enough data, a quarter of the cost
ENV = EnvConfig(id="MaskedCartPole-v1", _target_="app.runtime.envs.memory.masked_cartpole")
HP = PPOSettings(num_envs=4, num_steps=8, num_minibatches=2, update_epochs=1, lr=3e-3)
MODEL = {"width": 16, "layers": 2, "heads": 2, "context": 4}
# name: (loop.data_parallel, sequence size, tensor size), over 4 trainers.
CONFIGS = {"sp2-ddp2": ("ddp", 2, None), "sp2-fsdp2": ("fsdp", 2, None),
           "sp2-tp2": ("ddp", 2, 2), "sp2-tp2-fsdp": ("fsdp", 2, 2)}


def _segments(agent: Agent, algorithm: PPO, seed: int) -> list[Segment]:
    """``DISTINCT`` segments of collector ``seed``, collected with the initial policy (so every
    configuration trains on exactly the same data)."""
    worker = RolloutWorker(algorithm, probe_spaces(ENV), ENV, agent, seed)
    segments = [as_segment(worker.segment_format, worker.collect(agent, 0)[0].clone())
                for _ in range(DISTINCT)]
    worker.close()
    return segments


def _gather_without_remote_gradient(part: Tensor, group: Any) -> Tensor:
    """The window gathered as ``gather_window`` does, but the other ranks' chunks are constants:
    what a plain ``dist.all_gather`` spliced around the local chunk gives."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.detach().contiguous(), group=group)
    parts[dist.get_rank(group)] = part
    return torch.cat(parts, dim=1)


def _train(rank: int, world: int, data_parallel: str, sequence: int | None, tensor: int | None,
           replica: int, drop_gather_gradient: bool = False) -> dict[str, Any]:
    """``UPDATES`` PPO updates on this rank's grid. Every rank collects its own segments
    (collector ``rank``); a replica of ``replica`` ranks trains on its ranks' segments: shared
    over the grid, or (DDP, no grid) collected by each of its ranks alike."""
    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(world)),
                                  tensor_parallel_size=tensor, sequence_parallel_size=sequence))
    grid = TrainerGrid.of(plan)
    assert grid.replica_size in (1, replica)
    with planned_context(plan, timeout=120) as ctx:
        spaces = probe_spaces(ENV)
        torch.manual_seed(0)
        net = TransformerActorCritic(spaces, **MODEL)
        agent = Agent(net, spaces, ENV, context=MODEL["context"])
        algorithm = PPO(HP, spaces)
        first = rank - rank % replica
        collectors = [rank] if grid.replica_size > 1 else list(range(first, first + replica))
        own = {seed: _segments(agent, algorithm, seed) for seed in collectors}
        trained = TrainedModule(ctx, plan, net, shape_of(plan, data_parallel))
        if drop_gather_gradient:
            for block in trained.trained.layers:  # type: ignore[union-attr]
                block.attention.gather = _gather_without_remote_gradient
        optimizer = algorithm.optimizer(trained.trained)
        assert replica_rank(plan, rank) == (first if grid.replica_size > 1 else rank)
        generator, losses = torch.Generator(), []
        for update in range(UPDATES):
            segments = [own[seed][update % DISTINCT] for seed in collectors]
            if grid.replica_size > 1:
                segments = share_replica_segments(ctx, grid, segments)
            generator.manual_seed(1_000 * first + update)
            info = UpdateInfo(optimizer, generator, update * 128, update, 0)
            losses.append(algorithm.update(trained.model, net, segments, info))
            trained.publish()
        return {"losses": losses,
                "checksum": float(sum(p.detach().double().sum() for p in net.parameters())),
                "sharded": type(next(trained.trained.parameters())).__name__}


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_sequence_parallel_trains_as_ddp_does_and_a_gather_without_gradient_does_not() -> None:
    # DDP over 4 trainers, replicas of 2 ranks (as sp2 x dp2) and of all 4 (as sp2 x tp2).
    references = {size: mean_losses(run_ranks(_train, 4, "ddp", None, None, size, timeout=300))
                  for size in (2, 4)}
    for name, (data_parallel, sequence, tensor) in CONFIGS.items():
        replica = sequence * (tensor or 1)
        results = run_ranks(_train, 4, data_parallel, sequence, tensor, replica, timeout=300)
        gap, where = largest_gap(references[replica], mean_losses(results))
        assert gap < TOLERANCE, f"{name}: {where} differs from DDP by {gap:.2e} (relative)"
        checksums = {round(r["checksum"], 3) for r in results.values()}
        assert len(checksums) == 1, f"{name}: the published weights differ between ranks"
        assert results[0]["sharded"] == "DTensor", name
    dropped = run_ranks(_train, 4, "ddp", 2, None, 2, True, timeout=300)
    gap, where = largest_gap(references[2], mean_losses(dropped))
    assert gap > 10 * TOLERANCE, f"a dropped gather gradient moved the losses by only {gap:.2e}"
