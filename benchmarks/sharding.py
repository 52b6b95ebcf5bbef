"""12. Sharded trainers (app/runtime/trainer/trained.py): memory and step time per trainer grid.

Four trainer ranks train the transformer policy (``WIDTH`` x ``LAYERS``, Adam) on the same
batches under each way the runtime wraps it: DDP over 4, FSDP2 over 4, tensor parallel 2 x DDP 2
(composable ``replicate``) and tensor parallel 2 x FSDP2 2.

- **Memory:** each trainer's bytes of parameters, gradients and optimizer state (its local
  shards, after a step), against DDP's. Goal under FSDP over N=4: at most 1/N + 10% of DDP's
  (ratio <= 0.35). The acting copy a sharded trainer also holds (the whole weights, gathered
  after each update) is not in these bytes; its row says how large it is.
- **Step time:** one forward, backward, gradient clip and Adam step on a batch of ``BATCH``
  windows, median over repetitions. No goal on CPU.
- **Hand-off** (app/runtime/handoff/weights_sharded.py): two trainers under FSDP2 hand a model of
  ``HAND_OFF_PARAMS`` to 2 and 3 rollout ranks: each sends its own shard (its large slices
  straight from the shard) and every rollout rank receives them into its whole weights, in
  place, against the flat hand-off's broadcast of the same bytes from one trainer (bound
  buffers, in-place receives: today's static path). Each path has an agent of its own on every
  rank. A sample starts at a barrier and ends when the last rollout rank holds the whole
  weights. Goal: at most 1.1 x the flat broadcast. The largest send buffer on a trainer is
  reported beside it (the sharded owners' hold only their small slices and headers: no trainer
  holds a full-model send buffer).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .core import BYTES, SECONDS, Goal, Row, Settings, Stat

NAME = "sharding"
WIDTH, LAYERS, HEADS, CONTEXT, BATCH = 256, 4, 8, 8, 256
GRIDS = {"ddp4": ("ddp", None), "fsdp4": ("fsdp", None), "tp2-ddp2": ("ddp", 2),
         "tp2-fsdp2": ("fsdp", 2)}
HAND_OFF_PARAMS = {"1M": (1, 1000), "25M": (4, 2500), "100M": (4, 5000)}  # layers x width^2
HAND_OFF_TRAINERS = 2
# A layout with rollout ranks gives each trainer a rollout rank at least: 2 and 3 receivers, not 1.
HAND_OFF_ROLLOUTS = (2, 3)


def _static_shape(plan: Any, data_parallel: str) -> Any:
    """The run's shape the launcher would derive for PPO on ``plan`` (app/launch/shape.py),
    rollout ranks and trainers static, as these measurements build the trainers themselves."""
    from app.launch.shape import Asked, derive_shape
    from app.loops.ppo import PPOLoop

    return derive_shape(plan, PPOLoop(data_parallel=data_parallel),
                        Asked(elastic_rollouts=False, elastic_trainers=False))


def _measure(rank: int, world: int, data_parallel: str, tensor: int | None,
             reps: int) -> dict[str, Any]:
    import gymnasium as gym
    import numpy as np
    import torch
    from torch.distributed.tensor import DTensor

    from app.runtime.core.algorithm import Spaces
    from app.runtime.models.transformer import TransformerActorCritic
    from app.runtime.trainer.trained import TrainedModule
    from rlcomm import LayoutSpec, plan_layout
    from rlcomm.testing import planned_context

    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(world)),
                                  tensor_parallel_size=tensor))
    with planned_context(plan, timeout=300) as ctx:
        spaces = Spaces(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
        torch.manual_seed(0)
        net = TransformerActorCritic(spaces, WIDTH, LAYERS, HEADS, CONTEXT)
        trained = TrainedModule(ctx, plan, net, _static_shape(plan, data_parallel))
        optimizer = torch.optim.Adam(trained.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(rank // (tensor or 1))
        obs = torch.rand(BATCH, CONTEXT, 5, generator=generator)
        actions = torch.randint(0, 2, (BATCH,), generator=generator)

        def step() -> float:
            start = time.perf_counter()
            logprob, entropy, value = trained.model(obs, actions)
            loss = -(logprob.mean() + 0.01 * entropy.mean()) + value.pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained.model.parameters(), 0.5)
            optimizer.step()
            return time.perf_counter() - start

        step()  # warm-up: the optimizer state exists from here on
        times = [step() for _ in range(reps)]

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        params = list(trained.parameters())
        nbytes = sum(local(p).nbytes for p in params)
        nbytes += sum(local(p.grad).nbytes for p in params if p.grad is not None)
        nbytes += sum(local(v).nbytes for state in optimizer.state.values()
                      for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
        return {"bytes": nbytes, "step_s": statistics.median(times),
                "acting_bytes": sum(p.nbytes for p in net.parameters()) if trained.sharded else 0}


def _flat_hand_off(
    ctx: Any, rank: int, ranks: list[int], agent: Any
) -> tuple[Callable[[], None], Any]:
    """The flat path: rank 0 broadcasts the whole agent to ``ranks``; its step and sender."""
    from rlcomm import register_initializer
    from rlcomm.group_initializer import WeightTransferGroupInitializer
    from rlcomm.weights import WeightReceiver, WeightSender

    register_initializer("FLAT_HAND_OFF", WeightTransferGroupInitializer)
    ctx.init_group(ranks, mode="FLAT_HAND_OFF", backend="gloo")
    sender = receiver = None
    if rank == 0:
        sender = WeightSender(ctx, "FLAT_HAND_OFF")
        sender.bind(agent)
    elif rank in ranks:
        receiver = WeightReceiver(ctx, "FLAT_HAND_OFF", expected=agent.state_dict())
        receiver.bind(agent)

    def once() -> None:
        if sender is not None:
            sender.send(agent, wait=True)
        elif receiver is not None:
            receiver.receive_into(agent)

    return once, sender


def _hand_off(rank: int, world: int, layers: int, width: int, reps: int) -> dict[str, Any]:
    import torch
    from torch import nn

    from app.runtime.core.segments import Field, SegmentFormat
    from app.runtime.handoff import HandOffSettings, static_hand_off
    from app.runtime.handoff.weights_sharded import ShardSender
    from app.runtime.trainer.trained import TrainedModule
    from rlcomm import LayoutSpec, plan_layout
    from rlcomm.testing import planned_context

    trainers = list(range(HAND_OFF_TRAINERS))
    plan = plan_layout(LayoutSpec(world_size=world, trainers=trainers))
    with planned_context(plan, timeout=600) as ctx:
        def model() -> tuple[nn.Module, nn.Module]:
            torch.manual_seed(0)
            agent = nn.Module()
            agent.net = net = nn.Sequential(*[nn.Linear(width, width, bias=False)
                                              for _ in range(layers)])
            return agent, net

        # Each path has its agent: the flat receiver points its agent's tensors at its own
        # receive buffer, and the sharded one receives into its agent's own tensors.
        (agent, net), (flat_agent, _) = model(), model()
        trained = (TrainedModule(ctx, plan, net, _static_shape(plan, "fsdp"))
                   if rank in trainers else None)
        settings = HandOffSettings(max_staleness=0, verify_every=0, min_rollouts=1,
                                   timeout_s=600, episode_cap=1, sharded=True)
        segment_format = SegmentFormat({"version": Field((1,), torch.int64)})
        sharded = static_hand_off(ctx, plan, agent, segment_format, trained, settings)
        flat_once, flat_sender = _flat_hand_off(ctx, rank, [0, *plan.rollouts], flat_agent)

        def sharded_once() -> None:
            sharded.sync_weights(first=False)
            sharded.before_optimizer_step()

        times: dict[str, list[float]] = {"sharded": [], "flat": []}
        sharded.sync_weights(first=True)  # the layouts and the indices travel once
        flat_once()
        for _ in range(reps):
            for name, once in (("sharded", sharded_once), ("flat", flat_once)):
                torch.distributed.barrier()
                start = time.perf_counter()
                once()
                times[name].append(time.perf_counter() - start)
        whole = sum(t.nbytes for t in flat_agent.state_dict().values())
        # What a trainer's send buffers hold (the sharded owners send their large slices from
        # their shards: not in them).
        channel = sharded.weights
        shard_sender = channel.sender if isinstance(channel, ShardSender) else None
        send_bytes = {"sharded": shard_sender.buffer_bytes if shard_sender is not None else 0,
                      "flat": flat_sender.buffer_bytes if flat_sender is not None else 0}
        return {"times": times, "send_bytes": send_bytes, "whole": whole}


def _hand_off_rows(settings: Settings) -> list[Row]:
    from rlcomm.testing import run_ranks

    rows = []
    for size, (layers, width) in HAND_OFF_PARAMS.items():
        for rollouts in HAND_OFF_ROLLOUTS:
            world = HAND_OFF_TRAINERS + rollouts
            found = run_ranks(_hand_off, world, layers, width,
                              settings.reps(5 if size == "100M" else 10, 3), timeout=1200)
            # A sample ends when the slowest rank is done with it.
            samples = {name: [max(r["times"][name][i] for r in found.values())
                              for i in range(len(found[0]["times"][name]))]
                       for name in ("sharded", "flat")}
            ratio = statistics.median(samples["sharded"]) / statistics.median(samples["flat"])
            largest = {name: max(r["send_bytes"][name] for r in found.values())
                       for name in ("sharded", "flat")}
            rows.append(Row(
                NAME, f"hand-off {size} params to {rollouts} rollout rank(s): sharded "
                      f"({HAND_OFF_TRAINERS} owners) vs flat broadcast", unit=SECONDS,
                rlcomm=Stat.of(samples["sharded"]), reference=Stat.of(samples["flat"]),
                ratio=Stat.single(ratio), reference_name="flat broadcast",
                goal=Goal("<=", 1.1),
                note=(f"largest send buffer on a trainer: {largest['sharded']:,} B sharded, "
                      f"{largest['flat']:,} B flat (whole: {found[0]['whole']:,} B)")))
    return rows


def run(settings: Settings) -> list[Row]:
    from rlcomm.testing import run_ranks

    reps = settings.reps(20, 5)
    found = {name: run_ranks(_measure, 4, dp, tp, reps, timeout=600)
             for name, (dp, tp) in GRIDS.items()}
    ddp_bytes = max(r["bytes"] for r in found["ddp4"].values())
    rows = []
    for name, results in found.items():
        most = max(r["bytes"] for r in results.values())
        ratio = most / ddp_bytes
        rows.append(Row(
            NAME, f"param + grad + optimizer bytes per trainer: {name} vs ddp4", unit=BYTES,
            rlcomm=Stat.single(most), reference=Stat.single(ddp_bytes),
            ratio=Stat.single(ratio), reference_name="ddp4",
            goal=Goal("<=", 0.35) if name == "fsdp4" else None,
            note=(f"plus the acting copy: {max(r['acting_bytes'] for r in results.values()):,} B"
                  if name != "ddp4" else "")))
    ddp_step = [r["step_s"] for r in found["ddp4"].values()]
    for name, results in found.items():
        steps = [r["step_s"] for r in results.values()]
        rows.append(Row(NAME, f"step time (batch {BATCH}): {name} vs ddp4", unit=SECONDS,
                        rlcomm=Stat.of(steps), reference=Stat.of(ddp_step),
                        ratio=Stat.single(statistics.median(steps) / statistics.median(ddp_step)),
                        reference_name="ddp4"))
    return rows + _hand_off_rows(settings)
