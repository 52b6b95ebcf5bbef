"""2. Collectives: rlcomm's mode-addressed wrappers against the raw ``dist.*`` call on the same
group (4 ranks, INTRA_NODE of the default layout), at 4 bytes and 1 MiB.

Wrapper and raw samples alternate within every repetition (ABBA...), so drift cancels in the
per-repetition ratio. A sample is ``inner`` back-to-back calls after a barrier, timed on the
last rank (a receiver of the broadcast) until its last call returns, so no barrier is inside
the time. The raw all_gather writes into a preallocated output; the wrapper allocates its
output on each call. The wrapper's own cost is also measured on torch's fake backend, where a
collective does no communication, so that its few microseconds are not lost in the noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from rlcomm import CommContext, LayoutSpec, ParallelMode, plan_layout
from rlcomm import collectives as C
from rlcomm.testing import run_ranks

from .core import Goal, Row, Settings, compare, interleave, timed
from .procs import backend_for, rank_device, run_forked, sync_fn

NAME = "collectives"
WORLD = 4
MODE = ParallelMode.INTRA_NODE
GOAL = Goal("<=", 1.05)
SIZES = {"4 B": 1, "1 MiB": 2**20 // 4}  # float32 elements
OPS = ("all_reduce", "broadcast", "all_gather")
Samples = dict[str, list[float]]


def op_pair(ctx: CommContext, op: str, tensor: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The wrapper call and the raw call it stands for, on this rank's ``MODE`` group."""
    group = ctx.get_group(MODE)
    if op == "all_reduce":
        return {
            "rlcomm": partial(C.all_reduce, ctx, MODE, tensor),
            "raw": partial(dist.all_reduce, tensor, group=group),
        }
    if op == "broadcast":
        src = ctx.get_declared_ranks(MODE)[0]
        return {
            "rlcomm": partial(C.broadcast, ctx, MODE, tensor),
            "raw": partial(dist.broadcast, tensor, src=src, group=group),
        }
    out = tensor.new_empty(ctx.get_world_size(MODE) * tensor.numel())
    return {
        "rlcomm": partial(C.all_gather, ctx, MODE, tensor),
        "raw": partial(dist.all_gather_single, out, tensor, group=group),
    }


def _setup(world_size: int, rank: int, backend: str) -> CommContext:
    plan = plan_layout(LayoutSpec(world_size=WORLD, trainers=[0, 1], rollouts=[2, 3]))
    ctx = CommContext()
    if backend == "fake":
        ctx.init_distributed_env(world_size, rank, backend="fake", timeout=60)
    else:
        ctx.init_distributed_env(backend=backend, timeout=300)
    for spec in plan.groups:
        ctx.init_group([list(r) for r in spec.rank_lists], spec.mode, backend=backend)
    return ctx


def _rank_main(rank: int, world_size: int, reps: int, inner: dict[str, int]) -> dict[str, Samples]:
    backend = backend_for(world_size)
    ctx = _setup(world_size, rank, backend)
    try:
        device = rank_device(rank, backend)
        sync = sync_fn(ctx.get_group(MODE), backend)
        samples = {}
        for size, numel in SIZES.items():
            tensor = torch.ones(numel, device=device)
            for op in OPS:
                pair = op_pair(ctx, op, tensor)
                timers = {
                    k: partial(timed, call, inner[size], sync, trailing_sync=False)
                    for k, call in pair.items()
                }
                samples[f"{op} {size}"] = interleave(timers, reps, warmup=2)
        return samples
    finally:
        ctx.destroy()


def wrapper_overheads(calls: int = 2000, reps: int = 9) -> dict[str, float]:
    """Per op and size: median seconds the wrapper adds to the raw call on the fake backend
    (rank 0 of 4; the fake collectives move no data, so only the wrappers' work differs)."""
    ctx = _setup(WORLD, 0, "fake")
    overheads = {}
    for size, numel in SIZES.items():
        tensor = torch.ones(numel)
        for op in OPS:
            pair = op_pair(ctx, op, tensor)
            timers = {k: partial(timed, call, calls, lambda: None) for k, call in pair.items()}
            samples = interleave(timers, reps, warmup=1)
            diffs = [a - b for a, b in zip(samples["rlcomm"], samples["raw"])]
            overheads[f"{op} {size}"] = statistics.median(diffs)
    ctx.destroy()
    return overheads


def run(settings: Settings) -> list[Row]:
    reps = settings.reps(61, 13)
    inner = {"4 B": 20, "1 MiB": 4}
    samples = run_ranks(_rank_main, WORLD, reps, inner)[WORLD - 1]
    overheads = run_forked(wrapper_overheads, settings.reps(2000, 500), settings.reps(9, 5))
    rows = []
    for name, pair in samples.items():
        row = compare(
            NAME,
            f"{name} ({WORLD} ranks)",
            pair,
            "rlcomm",
            "raw",
            GOAL,
            note=f"{backend_for(WORLD)}, {MODE.value}; wrapper cost on the fake backend "
            f"{overheads[name] * 1e6:+.1f} us/call",
        )
        row.extra["fake_backend_overhead_seconds"] = overheads[name]
        rows.append(row)
    return rows
