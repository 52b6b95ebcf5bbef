"""12. Sharded trainers (app/runtime/sharding.py): memory and step time per trainer grid.

Four trainer ranks train the transformer policy (``WIDTH`` x ``LAYERS``, Adam) on the same
batches under each way the runtime wraps it: DDP over 4, FSDP2 over 4, tensor parallel 2 x DDP 2
(composable ``replicate``) and tensor parallel 2 x FSDP2 2.

- **Memory:** each trainer's bytes of parameters, gradients and optimizer state (its local
  shards, after a step), against DDP's. Goal under FSDP over N=4: at most 1/N + 10% of DDP's
  (ratio <= 0.35). The acting copy a sharded trainer also holds (the whole weights, gathered
  after each update) is not in these bytes; its row says how large it is.
- **Step time:** one forward, backward, gradient clip and Adam step on a batch of ``BATCH``
  windows, median over repetitions. No goal on CPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from .core import BYTES, SECONDS, Goal, Row, Settings, Stat

NAME = "sharding"
WIDTH, LAYERS, HEADS, CONTEXT, BATCH = 256, 4, 8, 8, 256
GRIDS = {"ddp4": ("ddp", None), "fsdp4": ("fsdp", None), "tp2-ddp2": ("ddp", 2),
         "tp2-fsdp2": ("fsdp", 2)}


def _measure(rank: int, world: int, data_parallel: str, tensor: int | None,
             reps: int) -> dict[str, Any]:
    import gymnasium as gym
    import numpy as np
    import torch
    from torch.distributed.tensor import DTensor

    from app.runtime.algorithm import Spaces
    from app.runtime.sharding import TrainedModule
    from app.runtime.transformer import TransformerActorCritic
    from rlcomm import CommContext, LayoutSpec, plan_layout

    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(world)),
                                  tensor_parallel_size=tensor))
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=300)
    ctx.init_groups(plan)
    try:
        spaces = Spaces(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
        torch.manual_seed(0)
        net = TransformerActorCritic(spaces, WIDTH, LAYERS, HEADS, CONTEXT)
        trained = TrainedModule(ctx, plan, net, data_parallel)
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
    finally:
        ctx.destroy()


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
    return rows
