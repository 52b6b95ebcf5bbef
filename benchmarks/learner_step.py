"""What one learner step of SAC, PPO and DQN costs, and what each lever does to it:
``python -m benchmarks.learner_step [--algorithms sac,ppo,dqn] [--threads 1,2]
[--compile off,inductor,cpp_wrapper] [--rounds R] [--steps N]``.

The steps, in one process, on random data of the shapes the runs use:

- **sac**: one learner step (``benchmarks.sac_step``'s: Hopper-v5, CleanRL's 256x256 networks,
  batches of 256), averaged over a cycle of ``policy_frequency`` steps;
- **ppo**: one minibatch step of ``+experiment=hopper`` (64-wide tanh MLPs, minibatches of 128:
  2t2r's 1,024 samples per trainer over 8 minibatches; on the experiment's own layout, 1t2r,
  one trainer takes minibatches of 256): the loss, its backward, the gradient clip and Adam;
- **dqn**: one learner step of ``loop=dqn`` on CartPole-v1 (CleanRL's 120x84 network, batches
  of 128, double DQN, Huber loss).

For each algorithm and thread count it builds one learner per ``loop.compile`` mode (the first
steps compile: their seconds are the compile column), then times them interleaved: ``--rounds``
rounds, each ``--steps`` steps of every mode in turn, so that load from other processes falls
on all alike. It prints, per mode, the step's FLOPs (torch's ``FlopCounterMode``), the median
step time over all rounds, the rate that makes, the machine's 256x256 product rate on as many
threads, and the 1-minute load average over the rounds (min..max). ``--profile ALGORITHM`` prints
torch.profiler's table of the step instead (compiled as ``--compile``'s first mode says, then
with a table of every kernel Inductor generated); ``--floor`` sets each step against its floor.

The levers' measured effects: docs/off-policy.md, "Learner speed".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import app.loops.sac.core as sac_core
from app.loops.dqn import DQN, DQNSettings
from app.loops.ppo.core import PPO, PPOBatch, PPOSettings, minibatch_step
from app.runtime.core.algorithm import Spaces, UpdateInfo
from app.runtime.core.compiling import COMPILE_MODES
from app.runtime.replay.buffer import Batch

from . import sac_step
from .sac_step import gemm_flops_per_s, step_flops, step_times

ALGORITHMS = ("sac", "ppo", "dqn")
PPO_OBS, PPO_ACT, PPO_MINIBATCH = 11, 3, 128  # Hopper-v5; 1,024 samples per trainer / 8
PPO_WIDTH = 64  # +experiment=hopper's MLPs
DQN_OBS, DQN_ACTIONS, DQN_BATCH = 4, 2, 128  # CartPole-v1; the replay's default batch
DQN_WIDTHS = (120, 84)  # loop=dqn's (CleanRL's) network
# --floor: widths and batch of the step "with no arithmetic" (its products are a few hundred
# FLOPs): what is left is the framework's cost per step (Python, dispatch, autograd, Adam).
TINY = 8


def _box(size: int, bound: float = np.inf) -> gym.spaces.Box:
    return gym.spaces.Box(-bound, bound, (size,), np.float32)


class PPOLearner:
    """PPO's minibatch step, ``+experiment=hopper``'s settings, one trainer."""

    cycle = 1

    def __init__(self, compile_mode: str = "off", width: int = PPO_WIDTH,
                 batch: int = PPO_MINIBATCH) -> None:
        torch.manual_seed(0)
        self.settings = PPOSettings(hidden_size=width, lr=3e-4, update_epochs=10,
                                    num_minibatches=8)
        self.ppo = PPO(self.settings, Spaces(observation=_box(PPO_OBS),
                                             action=_box(PPO_ACT, 1.0)))
        self.ppo.compile_mode = compile_mode
        self.net = self.ppo.build()
        self.model = sac_step.trained(self.net)
        self.optimizer = self.ppo.optimizer(self.net)
        g = torch.Generator().manual_seed(0)
        obs, actions = torch.randn(batch, PPO_OBS, generator=g), \
            torch.randn(batch, PPO_ACT, generator=g)
        with torch.no_grad():
            logprobs, _, values = self.net(obs, actions)
        self.batch = PPOBatch(obs, actions, logprobs, None, torch.randn(batch, generator=g),
                              values + torch.randn(batch, generator=g), values)

    def step(self) -> None:
        _minibatch_step(self.model, self.optimizer, self.batch, self.settings, self.ppo.loss_fn)


class DQNLearner:
    """``loop=dqn``'s learner step on CartPole-v1's shapes, one trainer."""

    cycle = 1

    def __init__(self, compile_mode: str = "off", widths: tuple[int, int] = DQN_WIDTHS,
                 batch: int = DQN_BATCH) -> None:
        torch.manual_seed(0)
        self.dqn = DQN(DQNSettings(hidden_sizes=list(widths)),
                       Spaces(observation=_box(DQN_OBS), action=gym.spaces.Discrete(DQN_ACTIONS)))
        self.dqn.compile_mode = compile_mode
        self.net = self.dqn.build()
        self.model = sac_step.trained(self.net)
        g = torch.Generator().manual_seed(0)
        self.info = UpdateInfo(self.dqn.optimizer(self.net), g, 0, 0, 0)
        n = batch
        self.batch = Batch(obs=torch.randn(n, DQN_OBS, generator=g),
                           actions=torch.randint(DQN_ACTIONS, (n,), generator=g),
                           rewards=torch.ones(n), next_obs=torch.randn(n, DQN_OBS, generator=g),
                           discounts=torch.full((n,), 0.99), weights=torch.ones(n),
                           indices=torch.arange(n), extras={})

    def step(self) -> None:
        self.dqn.learn(self.model, self.net, self.batch, self.info)
        self.dqn.learner_steps += 1


_minibatch_step = minibatch_step  # what PPOLearner steps (a lever may replace it)

LEARNERS: dict[str, Callable[[str], Any]] = {
    "sac": sac_step.Learner, "ppo": PPOLearner, "dqn": DQNLearner}

# The step with no arithmetic, per algorithm (see TINY).
TINY_LEARNERS: dict[str, Callable[[], Any]] = {
    "sac": lambda: sac_step.Learner("off", width=TINY, batch=TINY),
    "ppo": lambda: PPOLearner("off", width=TINY, batch=TINY),
    "dqn": lambda: DQNLearner("off", widths=(TINY, TINY), batch=TINY),
}


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, old)


def _fused_adam() -> contextlib.AbstractContextManager[None]:
    """Every Adam built inside is PyTorch's fused one (one kernel per step)."""
    adam = torch.optim.Adam
    return _patched(torch.optim, "Adam", functools.partial(adam, fused=True))


def _per_parameter_polyak() -> contextlib.AbstractContextManager[None]:
    """SAC's Polyak step as a Python loop of ``lerp_`` over the parameters."""
    def soft_update(target: torch.nn.Module, source: torch.nn.Module, tau: float) -> None:
        with torch.no_grad():
            for t, p in zip(target.parameters(), source.parameters(), strict=True):
                t.lerp_(p, tau)
    return _patched(sac_core, "soft_update", soft_update)


class _TwinQ(torch.nn.Module):
    """SAC's two Q-networks as one ensemble: each layer's weights stacked [2, in, out], one
    batched product (``baddbmm``) per layer for both networks (LeanRL's pattern, without vmap)."""

    def __init__(self, q1: torch.nn.Sequential, q2: torch.nn.Sequential) -> None:
        super().__init__()
        pairs: list[tuple[Any, Any]] = [(a, b) for a, b in zip(q1, q2, strict=True)
                                         if isinstance(a, torch.nn.Linear)]
        self.weights = torch.nn.ParameterList(
            [torch.stack([a.weight.detach().T, b.weight.detach().T]) for a, b in pairs])
        self.biases = torch.nn.ParameterList(
            [torch.stack([a.bias.detach(), b.bias.detach()]).unsqueeze(1) for a, b in pairs])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.expand(2, *x.shape)
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = torch.baddbmm(b, h, w)
            if i < len(self.weights) - 1:
                h = torch.relu(h)
        return h.squeeze(-1)  # [2, B]


class _TwinQModule(sac_core.SACModule):
    """SACModule with its Q-networks (and targets) as one :class:`_TwinQ` each."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.q1 = _TwinQ(self.q1, self.q2)  # type: ignore[assignment]
        self.q2 = torch.nn.Sequential()
        self.q1_target = copy.deepcopy(self.q1).requires_grad_(False)
        self.q2_target = torch.nn.Sequential()

    def q(self, obs: torch.Tensor, actions: torch.Tensor, target: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([obs.flatten(1).float(), actions.float()], -1)
        both = (self.q1_target if target else self.q1)(x)
        return both[0], both[1]


def _figures_per_step() -> contextlib.AbstractContextManager[None]:
    """PPO's figures read (``.item()``) after every minibatch step, not once per update."""
    def step(*args: Any) -> dict[str, Any]:
        return {k: v.item() for k, v in minibatch_step(*args).items()}
    return _patched(sys.modules[__name__], "_minibatch_step", step)


def _twin_q_ensemble() -> contextlib.AbstractContextManager[None]:
    return _patched(sac_core, "SACModule", _TwinQModule)


def _ddp_of_one() -> contextlib.AbstractContextManager[None]:
    """The net stepped through DDP over a gloo group of this process alone: what a lone trainer
    (``layout=single``, ``1t2r``) did before it trained its module bare."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return _patched(sac_step, "trained", DistributedDataParallel)


# A lever against the default step: (what it changes, the algorithms it applies to, a context
# that applies it to the learners built and stepped inside).
LEVERS: dict[str, tuple[str, tuple[str, ...], Callable[[], Any]]] = {
    "fused_adam": ("Adam(fused=True) for PPO and DQN (SAC's already is)", ("ppo", "dqn"),
                   _fused_adam),
    "figures_per_step": ("PPO's five figures read with .item() after each minibatch step",
                         ("ppo",), _figures_per_step),
    "twin_q_ensemble": ("SAC's twin Q-networks as one ensemble, one batched product per layer",
                        ("sac",), _twin_q_ensemble),
    "ddp_of_one": ("the step through DDP over a group of one (a lone trainer before)",
                   ALGORITHMS, _ddp_of_one),
    "per_parameter_polyak": ("SAC's targets stepped by a loop of lerp_, not one foreach",
                             ("sac",), _per_parameter_polyak),
}


def ab(algorithm: str, lever: str, rounds: int, steps: int) -> list[dict[str, Any]]:
    """The default step against it with ``lever``, interleaved as :func:`compare` does."""
    apply = LEVERS[lever][2]
    base = LEARNERS[algorithm]("off")
    with apply():
        other = LEARNERS[algorithm]("off")
    times: dict[str, list[float]] = {"default": [], lever: []}
    loads = [_load1()]
    for _ in range(rounds):
        times["default"] += step_times(base, steps, warmup=2)
        with apply():
            times[lever] += step_times(other, steps, warmup=2)
        loads.append(_load1())
    flops = step_flops(LEARNERS[algorithm]("off"))
    peak = gemm_flops_per_s()
    return [{"algorithm": algorithm, "threads": torch.get_num_threads(), "compile": name,
             "compile_s": 0.0, "gflop_per_step": flops / 1e9,
             "step_ms": statistics.median(t) * 1e3, "step_gflops": flops / statistics.median(t) / 1e9,
             "gemm_gflops": peak / 1e9, "load": (min(loads), max(loads))}
            for name, t in times.items()]


def _load1() -> float:
    return os.getloadavg()[0]


def compare(algorithm: str, modes: list[str], rounds: int, steps: int) -> list[dict[str, Any]]:
    """Each mode's learner, built and warmed (compiled) once, then timed in ``rounds``
    interleaved rounds of ``steps`` steps: one row per mode."""
    learners, compile_s = {}, {}
    for mode in modes:
        start = time.perf_counter()
        learners[mode] = LEARNERS[algorithm](mode)
        for _ in range(3 * learners[mode].cycle):  # compiles every function the step calls
            learners[mode].step()
        compile_s[mode] = time.perf_counter() - start
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    loads = [_load1()]
    for _ in range(rounds):
        for mode in modes:
            times[mode] += step_times(learners[mode], steps, warmup=2)
        loads.append(_load1())
    flops = step_flops(LEARNERS[algorithm]("off"))
    peak = gemm_flops_per_s()
    return [{"algorithm": algorithm, "threads": torch.get_num_threads(), "compile": mode,
             "compile_s": compile_s[mode], "gflop_per_step": flops / 1e9,
             "step_ms": statistics.median(times[mode]) * 1e3,
             "step_gflops": flops / statistics.median(times[mode]) / 1e9,
             "gemm_gflops": peak / 1e9, "load": (min(loads), max(loads))} for mode in modes]


def floor(algorithm: str, rounds: int, steps: int) -> dict[str, Any]:
    """The step against its floor on these cores: the same step with no arithmetic (widths and
    batch of ``TINY``: the framework's cost alone) plus the step's FLOPs at the 256x256 product
    rate, timed interleaved as :func:`compare` does."""
    full, tiny = LEARNERS[algorithm]("off"), TINY_LEARNERS[algorithm]()
    times: dict[str, list[float]] = {"step": [], "framework": []}
    per_round = []  # the step's median per round: the machine's own drift shows here
    loads = [_load1()]
    for _ in range(rounds):
        this_round = step_times(full, steps, warmup=2)
        times["step"] += this_round
        per_round.append(statistics.median(this_round) * 1e3)
        times["framework"] += step_times(tiny, steps, warmup=2)
        loads.append(_load1())
    flops = step_flops(LEARNERS[algorithm]("off"))
    peak = gemm_flops_per_s()
    step_ms, framework_ms = (statistics.median(times[k]) * 1e3 for k in ("step", "framework"))
    arithmetic_ms = flops / peak * 1e3
    return {"algorithm": algorithm, "threads": torch.get_num_threads(),
            "gflop_per_step": flops / 1e9, "gemm_gflops": peak / 1e9, "step_ms": step_ms,
            "rounds_ms": (min(per_round), max(per_round)),
            "framework_ms": framework_ms, "arithmetic_ms": arithmetic_ms,
            "floor_ms": framework_ms + arithmetic_ms,
            "rest_ms": step_ms - framework_ms - arithmetic_ms, "load": (min(loads), max(loads))}


def floor_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| algorithm | threads | step (its rounds' medians) | framework alone (widths and "
             f"batch of {TINY}) | its FLOPs at the 256x256 product rate | floor (the two) "
             "| the rest (elementwise kernels, thin products, threads) | load average, 1 min |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['threads']} | {r['step_ms']:.3f} ms "
            f"({r['rounds_ms'][0]:.3f}..{r['rounds_ms'][1]:.3f}) | {r['framework_ms']:.3f} ms "
            f"| {r['arithmetic_ms']:.3f} ms ({r['gflop_per_step']:.4f} GFLOP at "
            f"{r['gemm_gflops']:.0f} GFLOP/s) | {r['floor_ms']:.3f} ms | {r['rest_ms']:.3f} ms "
            f"| {r['load'][0]:.2f}..{r['load'][1]:.2f} |")
    return lines


def profile(algorithm: str, mode: str = "off", steps: int = 50) -> str:
    """torch.profiler's table (by self CPU time) of ``steps`` steps, compiled as ``mode`` says;
    compiled, a second table lists every kernel Inductor generated, slowest first."""
    import torch._inductor.config as inductor_config
    from torch.autograd.profiler_util import EventList
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    # Compiled afresh: dynamo would reuse code this process compiled before (a new module of
    # the same shapes passes its guards), whose kernels record nothing.
    torch._dynamo.reset()
    with inductor_config.patch({"cpp.enable_kernel_profile": mode != "off"}):
        learner = LEARNERS[algorithm](mode)
        step_times(learner, 0, warmup=3 * learner.cycle)  # compiles every function it calls
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                learner.step()
    events = prof.key_averages()
    tables = [str(events.table(sort_by="self_cpu_time_total", row_limit=25))]
    # Each generated kernel is named graph_<n>_cpp_fused_<what it fuses>_<k>.
    kernels = EventList([e for e in events if "_cpp_fused_" in e.key])
    if kernels:
        tables.append(f"Inductor's kernels ({len(kernels)}):\n"
                      + str(kernels.table(sort_by="self_cpu_time_total", row_limit=-1)))
    return "\n".join(tables)


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| algorithm | threads | loop.compile, or lever | compile | GFLOP per step | step (median) "
             "| GFLOP/s in the step | 256x256 product alone | load average, 1 min |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['threads']} | {r['compile']} | {r['compile_s']:.1f} s "
            f"| {r['gflop_per_step']:.4f} | {r['step_ms']:.3f} ms | {r['step_gflops']:.1f} "
            f"| {r['gemm_gflops']:.1f} GFLOP/s | {r['load'][0]:.2f}..{r['load'][1]:.2f} |")
    return lines


def _names(known: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose among {', '.join(known)}")
        return names
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.learner_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", type=_names(ALGORITHMS), default=list(ALGORITHMS))
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")],
                        default=[1, 2], help="intra-op thread counts, comma-separated")
    parser.add_argument("--compile", type=_names(COMPILE_MODES), default=["off"],
                        help="loop.compile modes to compare, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per mode and round")
    parser.add_argument("--profile", choices=ALGORITHMS,
                        help="profile one algorithm's step (compiled as --compile's first mode)")
    parser.add_argument("--lever", choices=sorted(LEVERS),
                        help="time the default step against it with this lever instead")
    parser.add_argument("--floor", action="store_true",
                        help="time each step against its floor (the framework alone plus its "
                             "FLOPs at the product rate) instead")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        print(profile(args.profile, args.compile[0]))
        return 0
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"Learner steps, {time.strftime('%Y-%m-%d %H:%M')}; load average at the start {load}")
    rows = []
    threads = torch.get_num_threads()
    try:
        for algorithm in args.algorithms:
            for count in args.threads:
                torch.set_num_threads(count)
                if args.floor:
                    rows.append(floor(algorithm, args.rounds, args.steps))
                elif args.lever is None:
                    rows += compare(algorithm, args.compile, args.rounds, args.steps)
                elif algorithm in LEVERS[args.lever][1]:
                    rows += ab(algorithm, args.lever, args.rounds, args.steps)
    finally:
        torch.set_num_threads(threads)
    print("\n".join(floor_table(rows) if args.floor else table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
