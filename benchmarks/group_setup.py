"""3. Group setup on 4 real processes: ``CommContext.init_distributed_env`` plus ``init_group``
for every group of the default layout, against ``init_process_group`` plus the same
``new_group`` calls (plain ones: no ``use_local_synchronization``).

Each repetition uses a fresh TCP port for both, so neither reuses a store, and starts all ranks
together on a multiprocessing barrier; its sample is the slowest rank's time to having every
group. Teardown is not timed.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from rlcomm import CommContext, LayoutPlan, LayoutSpec, plan_layout
from rlcomm.testing import free_port, run_ranks

from .core import Goal, Row, Settings, compare
from .procs import backend_for

NAME = "group_setup"
WORLD = 4
GOAL = Goal("<=", 1.1)
TIMEOUT = 300  # seconds, for the rendezvous and every group (both sides)


def default_plan() -> LayoutPlan:
    return plan_layout(LayoutSpec(world_size=WORLD, trainers=[0, 1], rollouts=[2, 3]))


def rlcomm_setup(rank: int, port: int, backend: str, plan: LayoutPlan) -> Callable[[], None]:
    """Time this; returns the teardown."""
    ctx = CommContext()
    ctx.init_distributed_env(WORLD, rank, backend, f"tcp://127.0.0.1:{port}", timeout=TIMEOUT)
    for spec in plan.groups:
        ctx.init_group([list(r) for r in spec.rank_lists], spec.mode, backend=backend)
    return ctx.destroy


def raw_setup(rank: int, port: int, backend: str, plan: LayoutPlan) -> Callable[[], None]:
    """The same groups with torch alone; returns the teardown."""
    timeout = datetime.timedelta(seconds=TIMEOUT)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timeout,
    )
    for spec in plan.groups:
        for ranks in spec.rank_lists:
            dist.new_group(sorted(ranks), timeout=timeout, backend=backend)

    def teardown() -> None:
        dist.barrier()
        dist.destroy_process_group()

    return teardown


SETUPS = {"rlcomm": rlcomm_setup, "raw": raw_setup}


def _rank_main(
    rank: int, world_size: int, ports: list[dict[str, int]], start: Any
) -> dict[str, list[float]]:
    """One sample per (repetition, method): seconds from the common start to every group."""
    backend = backend_for(world_size)
    plan = default_plan()
    samples: dict[str, list[float]] = {name: [] for name in SETUPS}
    for rep, rep_ports in enumerate(ports):
        order = list(SETUPS) if rep % 2 == 0 else list(SETUPS)[::-1]
        for name in order:
            start.wait()
            began = time.perf_counter()
            teardown = SETUPS[name](rank, rep_ports[name], backend, plan)
            samples[name].append(time.perf_counter() - began)
            teardown()
    return samples


def run(settings: Settings) -> list[Row]:
    warmup, reps = 1, settings.reps(21, 7)
    ports = [{name: free_port() for name in SETUPS} for _ in range(warmup + reps)]
    start = mp.get_context("fork").Barrier(WORLD)
    per_rank = run_ranks(_rank_main, WORLD, ports, start)
    # A repetition ends when the slowest rank has its groups.
    samples = {
        name: [max(per_rank[r][name][i] for r in per_rank) for i in range(warmup, warmup + reps)]
        for name in SETUPS
    }
    plan = default_plan()
    calls = sum(len(spec.rank_lists) for spec in plan.groups)
    row = compare(
        NAME,
        f"init + {calls} groups of the default layout ({WORLD} ranks)",
        samples,
        "rlcomm",
        "raw",
        GOAL,
        note=f"{backend_for(WORLD)}; {', '.join(g.mode for g in plan.groups)}",
    )
    assert row.reference is not None
    row.extra["raw_seconds_per_group_including_init"] = row.reference.median / calls
    return [row]
