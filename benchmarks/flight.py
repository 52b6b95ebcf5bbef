"""7. Flight recorder: what recording every collective (always on, for hang diagnosis) costs.

- A small all_reduce (4 B, 4 ranks, gloo) with recording on against the same call with it off
  (``ctx.recorder.enabled`` toggled in the same ranks, samples interleaved as in
  ``collectives``; the watchdog thread runs in both). The recorder's own cost per call is also
  measured on the fake backend, where a collective does no communication.
- The default PPO run (fixed budget of env steps, so both sides do the same work) with
  ``comm.record=true`` against ``comm.record=false`` (no recording, no watchdog), launch to
  exit, runs alternated; not in ``--quick``.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from functools import partial

import torch

from rlcomm import CommContext
from rlcomm import collectives as C
from rlcomm.testing import run_ranks

from .collectives import MODE, WORLD, _setup
from .core import Goal, Row, Settings, Stat, compare, interleave, ratios, timed
from .procs import CommandTimeoutError, backend_for, rank_device, run_forked, sync_fn, timed_command

NAME = "flight"
CALL_GOAL = Goal("<=", 1.02)
RUN_GOAL = Goal("<=", 1.01)
PPO_RUN = ["loop=ppo", "loop.target_return=1e9", "loop.total_env_steps=49152", "loop.progress=false"]
RUN_TIMEOUT_S = 200.0


def _switch(ctx: CommContext, on: bool, call: Callable[[], object]) -> Callable[[], object]:
    def step() -> object:
        ctx.recorder.enabled = on
        return call()

    return step


def _rank_main(rank: int, world_size: int, reps: int, inner: int) -> dict[str, list[float]]:
    backend = backend_for(world_size)
    ctx = _setup(world_size, rank, backend)
    try:
        tensor = torch.ones(1, device=rank_device(rank, backend))
        sync = sync_fn(ctx.get_group(MODE), backend)
        call = partial(C.all_reduce, ctx, MODE, tensor)
        timers = {
            name: partial(timed, _switch(ctx, on, call), inner, sync, trailing_sync=False)
            for name, on in (("on", True), ("off", False))
        }
        return interleave(timers, reps, warmup=2)
    finally:
        ctx.destroy()


def recorder_cost(calls: int = 5000, reps: int = 9) -> float:
    """Median seconds recording adds to one all_reduce on the fake backend (rank 0 of 4)."""
    ctx = _setup(WORLD, 0, "fake")
    tensor = torch.ones(1)
    call = partial(C.all_reduce, ctx, MODE, tensor)
    timers = {
        name: partial(timed, _switch(ctx, on, call), calls, lambda: None)
        for name, on in (("on", True), ("off", False))
    }
    samples = interleave(timers, reps, warmup=1)
    ctx.destroy()
    return statistics.median(a - b for a, b in zip(samples["on"], samples["off"]))


def _ppo_rows(settings: Settings) -> list[Row]:
    name = "default PPO run (49,152 env steps): wall time, recording on vs off"
    if settings.quick:
        return [Row(NAME, name, status="skipped", note="not in --quick")]
    samples: dict[str, list[float]] = {"on": [], "off": []}
    base = settings.out_dir / "flight"
    for index, side in enumerate(("on", "off", "off", "on")):
        if settings.seconds_left() < RUN_TIMEOUT_S:
            break
        argv = [sys.executable, "-m", "app", *PPO_RUN, f"comm.record={side == 'on'}",
                f"hydra.run.dir={base / f'{index}_{side}'}"]
        try:
            seconds, done = timed_command(argv, RUN_TIMEOUT_S)
        except CommandTimeoutError as err:
            return [Row(NAME, name, status="timeout", note=str(err)[:300])]
        if done.returncode != 0:
            tail = " / ".join(done.stderr.strip().splitlines()[-2:])
            return [Row(NAME, name, status="failed", note=tail[:300])]
        samples[side].append(seconds)
    if not samples["on"] or len(samples["on"]) != len(samples["off"]):
        return [Row(NAME, name, status="skipped", note="not enough of the time budget left")]
    pairs = len(samples["on"])
    return [Row(NAME, name, rlcomm=Stat.of(samples["on"]), reference=Stat.of(samples["off"]),
                ratio=ratios(samples["on"], samples["off"]), goal=RUN_GOAL,
                reference_name="comm.record=false",
                note=f"{pairs} pair(s) of runs, alternated; on 2 shared cores run-to-run noise "
                "is several percent")]


def run(settings: Settings) -> list[Row]:
    reps, inner = settings.reps(61, 13), 20
    samples = run_ranks(_rank_main, WORLD, reps, inner)[WORLD - 1]
    cost = run_forked(recorder_cost, settings.reps(5000, 1000), settings.reps(9, 5))
    row = compare(
        NAME, f"all_reduce 4 B ({WORLD} ranks): recording on vs off", samples, "on", "off",
        CALL_GOAL,
        note=f"{backend_for(WORLD)}, {MODE.value}; recording costs {cost * 1e6:+.2f} us/call "
        "on the fake backend",
    )
    row.extra["fake_backend_recording_seconds"] = cost
    return [row, *_ppo_rows(settings)]
