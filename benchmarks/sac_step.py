"""What one SAC learner step costs, against what this machine's cores can do:
``python -m benchmarks.sac_step [--steps N]``.

SAC's learner step (``loop=sac``, Hopper-v5's shapes: 11 observations, 3 actions, CleanRL's
256x256 networks and batches of 256) is dense matrix products. This prints, for 1 and 2
intra-op threads:

- the floating-point operations of a learner step, counted by torch's ``FlopCounterMode`` and
  averaged over ``policy_frequency`` steps (the actor and alpha steps come every 2nd step, two
  at a time);
- the step's wall time (the median over about ``--steps`` steps, timed in whole cycles, after a
  warm-up) and the rate that gives;
- this machine's rate on a 256x256 by 256x256 matrix product, the shape of the networks'
  hidden layers, alone: the most the step's products could reach;
- so the fewest milliseconds a step could take at that rate, against the step's own.

It answers how much faster a learner step could get on these cores without changing what it
computes (docs/benchmarks.md, "Off-policy throughput"). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from app.loops.sac import SAC, SACSettings
from app.runtime.core.algorithm import Spaces, UpdateInfo
from app.runtime.replay.buffer import Batch

OBS, ACT, BATCH = 11, 3, 256  # Hopper-v5's observation and action sizes; CleanRL's batch
GEMM = 256  # the hidden layers' width: a 256x256 by 256x256 product is the step's typical one


def _batch(generator: torch.Generator, size: int = BATCH) -> Batch:
    return Batch(obs=torch.randn(size, OBS, generator=generator),
                 actions=torch.rand(size, ACT, generator=generator) * 2 - 1,
                 rewards=torch.randn(size, generator=generator),
                 next_obs=torch.randn(size, OBS, generator=generator),
                 discounts=torch.full((size,), 0.99), weights=torch.ones(size),
                 indices=torch.arange(size), extras={})


def trained(net: torch.nn.Module) -> torch.nn.Module:
    """What a learner steps ``net`` through: the net itself, as a lone trainer trains it
    (``benchmarks.learner_step``'s ``ddp_of_one`` lever wraps it in DDP instead)."""
    return net


class Learner:
    """One trainer's SAC (no DDP), stepping on random batches of Hopper's shapes (CleanRL's
    widths and batch unless ``width`` and ``batch`` say otherwise)."""

    def __init__(self, compile_mode: str = "off", width: int = GEMM, batch: int = BATCH) -> None:
        torch.manual_seed(0)
        spaces = Spaces(observation=gym.spaces.Box(-np.inf, np.inf, (OBS,), np.float32),
                        action=gym.spaces.Box(-1.0, 1.0, (ACT,), np.float32))
        self.sac = SAC(SACSettings(hidden_sizes=[width, width]), spaces)
        self.sac.compile_mode = compile_mode
        self.cycle = self.sac.settings.policy_frequency  # steps of one full cycle
        self.net = self.sac.build()
        self.model = trained(self.net)
        self.generator = torch.Generator().manual_seed(0)
        self.info = UpdateInfo(self.sac.optimizer(self.net), self.generator, 0, 0, 0)
        self.batch = _batch(self.generator, batch)

    def step(self) -> None:
        self.sac.learn(self.model, self.net, self.batch, self.info)
        self.sac.learner_steps += 1


def step_flops(learner: Any) -> float:
    """Floating-point operations per learner step, over one full ``learner.cycle`` of steps
    (SAC's: ``policy_frequency``)."""
    steps = learner.cycle
    with FlopCounterMode(display=False) as counter:
        for _ in range(steps):
            learner.step()
    return counter.get_total_flops() / steps


def step_times(learner: Any, steps: int, warmup: int = 20) -> list[float]:
    """Seconds per learner step over about ``steps`` steps, after ``warmup`` untimed ones: one
    figure per full ``learner.cycle`` of steps (its time / its steps). SAC's steps alternate
    between a Q step alone and a Q step with two actor steps (3.5 and 11 ms on two threads):
    a single step's time, or the median of them, is neither's cost nor their mean. Any
    ``cycle`` steps in a row hold one of each."""
    cycle = learner.cycle
    for _ in range(warmup):
        learner.step()
    times = []
    for _ in range(max(1, steps // cycle)):
        start = time.perf_counter()
        for _ in range(cycle):
            learner.step()
        times.append((time.perf_counter() - start) / cycle)
    return times


def seconds_per_step(learner: Any, steps: int) -> float:
    return statistics.median(step_times(learner, steps))


def gemm_flops_per_s(reps: int = 400) -> float:
    a, b = torch.randn(GEMM, GEMM), torch.randn(GEMM, GEMM)
    for _ in range(20):
        a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * GEMM**3 * reps / (time.perf_counter() - start)


def measure(steps: int) -> list[dict[str, Any]]:
    rows = []
    flops = step_flops(Learner())
    for threads in (1, 2):
        torch.set_num_threads(threads)
        step_s = seconds_per_step(Learner(), steps)
        peak = gemm_flops_per_s()
        rows.append({"threads": threads, "gflop_per_step": flops / 1e9, "step_ms": step_s * 1e3,
                     "step_gflops": flops / step_s / 1e9, "gemm_gflops": peak / 1e9,
                     "floor_ms": flops / peak * 1e3})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sac_step")
    parser.add_argument("--steps", type=int, default=300, help="timed learner steps per row")
    args = parser.parse_args(argv)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"SAC learner step, Hopper-v5 shapes, batch {BATCH}; load average {load}")
    print("| threads | GFLOP per step | step | GFLOP/s in the step | 256x256 product alone "
          "| step at that rate |")
    print("|---|---|---|---|---|---|")
    for row in measure(args.steps):
        print(f"| {row['threads']} | {row['gflop_per_step']:.3f} | {row['step_ms']:.2f} ms "
              f"| {row['step_gflops']:.1f} | {row['gemm_gflops']:.1f} GFLOP/s "
              f"| {row['floor_ms']:.2f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
