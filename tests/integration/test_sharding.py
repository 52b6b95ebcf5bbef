"""Sharded trainers (app/runtime/trainer/trained.py): the same PPO updates, to float precision, whether
the trainers replicate the model (DDP), shard it (FSDP2), split it (tensor parallel), or both;
and a dropped shard gradient is caught."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from app.loops.ppo.core import PPO, PPOSettings
from app.runtime import Segment, UpdateInfo
from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.models.transformer import TransformerActorCritic
from app.runtime.rollout.worker import Agent, RolloutWorker, as_segment
from app.runtime.trainer.trained import TrainedModule, TrainerGrid, share_segments
from rlcomm import LayoutSpec, ParallelMode, plan_layout
from rlcomm.testing import free_port, planned_context, run_ranks
from tests.helpers.parity import TOLERANCE, largest_gap, mean_losses
from tests.helpers.shapes import shape_of

UPDATES = 20
# Every configuration trains each replica on the segments of its pair of ranks (2k, 2k + 1):
# a tensor-parallel pair shares them (share_segments); elsewhere both ranks hold both.
ENV = EnvConfig(id="MaskedCartPole-v1", _target_="app.runtime.envs.memory.masked_cartpole")
HP = PPOSettings(num_envs=4, num_steps=16, num_minibatches=2, update_epochs=1, lr=3e-3)
MODEL = {"width": 32, "layers": 2, "heads": 4, "context": 4}
CONFIGS = {"ddp4": ("ddp", None), "fsdp4": ("fsdp", None), "tp2-ddp2": ("ddp", 2),
           "tp2-fsdp2": ("fsdp", 2)}


def _segments(agent: Agent, algorithm: PPO, seed: int) -> list[Segment]:
    """``UPDATES`` segments collected with the initial policy (so every configuration trains on
    exactly the same data)."""
    spaces = probe_spaces(ENV)
    worker = RolloutWorker(algorithm, spaces, ENV, agent, seed)
    segments = [as_segment(worker.segment_format, worker.collect(agent, 0)[0].clone())
                for _ in range(UPDATES)]
    worker.close()
    return segments


def _train(rank: int, world: int, ports: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Every configuration of ``ports`` (``CONFIGS``, then "dropped": tp2-fsdp2 with rank 1's
    shard of one gradient lost), one after the other on these ranks, each in its own gloo world.
    The segments are collected once per rank and reused: every configuration trains on the same
    data anyway, and collecting them is most of the cost."""
    own: dict[int, list[Segment]] = {}
    rng_after_collecting = torch.get_rng_state()
    results = {}
    for name, port in ports.items():
        data_parallel, tensor = CONFIGS.get(name, ("fsdp", 2))
        os.environ["MASTER_PORT"] = str(port)
        plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(world)),
                                      tensor_parallel_size=tensor))
        with planned_context(plan, timeout=120) as ctx:
            spaces = probe_spaces(ENV)
            torch.manual_seed(0)
            net = TransformerActorCritic(spaces, **MODEL)
            agent = Agent(net, spaces, ENV, context=MODEL["context"])
            algorithm = PPO(HP, spaces)
            pair = rank // 2
            if not own:
                own = {seed: _segments(agent, algorithm, seed)
                       for seed in (2 * pair, 2 * pair + 1)}
                rng_after_collecting = torch.get_rng_state()
            # Each configuration starts its updates from the same random state as the first.
            torch.set_rng_state(rng_after_collecting)
            results[name] = _updates(ctx, plan, rank, net, algorithm, own, data_parallel,
                                     name == "dropped")
    return results


def _updates(ctx: Any, plan: Any, rank: int, net: TransformerActorCritic, algorithm: PPO,
             own: dict[int, list[Segment]], data_parallel: str,
             drop_shard_grad: bool) -> dict[str, Any]:
    pair = rank // 2
    trained = TrainedModule(ctx, plan, net, shape_of(plan, data_parallel))
    optimizer = algorithm.optimizer(trained.trained)
    if drop_shard_grad and rank == 1:
        sharded = dict(trained.trained.named_parameters())["layers.1.feed_forward.w2.weight"]

        def drop(*_: Any) -> None:  # this rank's shard of one gradient, lost
            sharded.grad.to_local().zero_()  # type: ignore[union-attr]

        optimizer.register_step_pre_hook(drop)
    grid = TrainerGrid.of(plan)
    generator = torch.Generator()
    losses = []
    for update in range(UPDATES):
        if grid.tensor > 1:
            segments = share_segments(ctx, [own[rank][update]])
        else:
            segments = [own[seed][update] for seed in sorted(own)]
        generator.manual_seed(1_000 * pair + update)
        info = UpdateInfo(optimizer, generator, update * 256, update, 0)
        losses.append(algorithm.update(trained.model, net, segments, info))
        trained.publish()
    return {"losses": losses,
            "checksum": float(sum(p.detach().double().sum() for p in net.parameters())),
            "sharded": [type(p).__name__ for p in trained.trained.parameters()][:1]}


@pytest.mark.integration
def test_ddp_fsdp_tensor_parallel_and_both_train_alike_and_a_dropped_shard_gradient_does_not() -> None:
    ports = {name: free_port() for name in [*CONFIGS, "dropped"]}
    by_rank = run_ranks(_train, 4, ports, timeout=900)
    runs = {name: {r: by_rank[r][name] for r in by_rank} for name in ports}
    dropped = runs.pop("dropped")
    reference = mean_losses(runs["ddp4"])
    for name, results in runs.items():
        gap, where = largest_gap(reference, mean_losses(results))
        assert gap < TOLERANCE, f"{name}: {where} differs from ddp4 by {gap:.2e} (relative)"
        checksums = {round(r["checksum"], 3) for r in results.values()}
        assert len(checksums) == 1, f"{name}: the published weights differ between ranks"
    assert runs["tp2-fsdp2"][0]["sharded"] == ["DTensor"]
    gap, where = largest_gap(reference, mean_losses(dropped))
    assert gap > 10 * TOLERANCE, f"a dropped shard gradient moved the losses by only {gap:.2e}"


def _shared(rank: int, world: int) -> list[tuple[int, float]]:
    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(world)),
                                  tensor_parallel_size=2))
    with planned_context(plan, timeout=60) as ctx:
        mine = []
        for i in range(1 + rank % 2):  # ranks 1 and 3 bring two segments, 0 and 2 one
            segment = Segment({"obs": torch.full((3, 2), float(10 * rank + i))})
            segment.version, segment.lag = rank, i
            segment.moments = {"obs_moments": torch.tensor([rank], dtype=torch.float64)}
            mine.append(segment)
        return [(s.version, float(s["obs"][0, 0])) for s in share_segments(ctx, mine)]


@pytest.mark.integration
def test_a_tensor_parallel_pair_trains_on_both_ranks_segments_in_group_order() -> None:
    results = run_ranks(_shared, 4)
    assert results[0] == results[1] == [(0, 0.0), (1, 10.0), (1, 11.0)]
    assert results[2] == results[3] == [(2, 20.0), (3, 30.0), (3, 31.0)]
    assert ParallelMode.TENSOR_PARALLEL.value in plan_layout(
        LayoutSpec(world_size=4, trainers=[0, 1, 2, 3], tensor_parallel_size=2)).groups_of(0)
