"""4. Scale by simulation: torch's fake backend plays one rank of a 1,024 / 8,192 / 65,536-rank
job. The RL layout: ranks alternate trainer / rollout (each trainer paired with the next rank
for weight transfer), 8 ranks per node. Each measurement runs in a freshly forked process, as
rank 0 and as the last rank (a rollout rank), recording times and peak RSS:

- ``rlcomm``: ``plan_layout`` (plan + validate), ``init_distributed_env(backend="fake")`` and
  ``init_groups(plan)`` (what every rank of the app does);
- ``raw``: the same rank lists from plain comprehensions, ``init_process_group("fake")`` and a
  ``new_group`` loop;
- ``device_mesh``: ``init_device_mesh`` for the meshes that express the layout: (nodes, 8) gives
  INTER_NODE and INTRA_NODE, (pairs, 2) gives WEIGHT_TRANSFER and the trainers' data-parallel
  group (plus the rollouts' one, which the RL layout does not have).
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from rlcomm import CommContext, LayoutSpec, plan_layout

from .core import BYTES, Goal, Row, Settings, Stat, compare
from .procs import run_forked

NAME = "scale"
RANKS_PER_NODE = 8
PLANNER_GOAL = Goal("<", 1.0, on="rlcomm")  # seconds, at 65,536 ranks
CREATE_GOAL = Goal("<=", 1.1)
Measurement = dict[str, float]


def rl_spec(world: int) -> LayoutSpec:
    return LayoutSpec(
        world_size=world,
        ranks_per_node=RANKS_PER_NODE,
        trainers=list(range(0, world, 2)),
        rollouts=list(range(1, world, 2)),
    )


def raw_rank_lists(world: int) -> list[list[list[int]]]:
    """The RL layout's groups without the planner, in its creation order."""
    per, nodes = RANKS_PER_NODE, world // RANKS_PER_NODE
    return [
        [list(range(n * per, (n + 1) * per)) for n in range(nodes)],  # INTRA_NODE
        [list(range(i, world, per)) for i in range(per)],  # INTER_NODE
        [list(range(0, world, 2))],  # TRAIN_DATA_PARALLEL
        [[t, t + 1] for t in range(0, world, 2)],  # WEIGHT_TRANSFER
    ]


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class Phases:
    """Wall time and garbage-collection time per named phase (GC can land in any phase, and a
    full collection of a process that imported torch costs tens of milliseconds)."""

    def __init__(self) -> None:
        self.result: Measurement = {}
        self._gc_seconds = 0.0
        self._gc_started = 0.0
        self._gc_full = 0
        gc.callbacks.append(self._on_gc)
        self._last = self._last_start = time.perf_counter()
        self._last_gc = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_seconds += time.perf_counter() - self._gc_started
            self._gc_full += info["generation"] == 2

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.result[name] = now - self._last
        self.result[f"{name}_gc"] = self._gc_seconds - self._last_gc
        self._last, self._last_gc = now, self._gc_seconds

    def finish(self) -> Measurement:
        gc.callbacks.remove(self._on_gc)
        self.result["total"] = self._last - self._last_start
        self.result["total_gc"] = self._gc_seconds
        self.result["full_collections"] = self._gc_full
        return self.result


def measure_rlcomm(world: int, rank: int) -> Measurement:
    phases = Phases()
    plan = plan_layout(rl_spec(world))
    phases.mark("lists")
    ctx = CommContext()
    ctx.init_distributed_env(world, rank, backend="fake", timeout=600)
    phases.mark("init")
    ctx.init_groups(plan)
    phases.mark("create")
    return phases.finish()


def measure_raw(world: int, rank: int) -> Measurement:
    phases = Phases()
    lists = raw_rank_lists(world)
    phases.mark("lists")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    phases.mark("init")
    for mode_lists in lists:
        for ranks in mode_lists:
            dist.new_group(ranks)
    phases.mark("create")
    return phases.finish()


def measure_device_mesh(world: int, rank: int) -> Measurement:
    phases = Phases()
    phases.mark("lists")  # the mesh shape is all it needs
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    phases.mark("init")
    per = RANKS_PER_NODE
    init_device_mesh("cpu", (world // per, per), mesh_dim_names=("inter", "intra"))
    init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "pair"))
    phases.mark("create")
    return phases.finish()


METHODS: dict[str, Callable[[int, int], Measurement]] = {
    "rlcomm": measure_rlcomm,
    "raw": measure_raw,
    "device_mesh": measure_device_mesh,
}


def _measure(method: str, world: int, rank: int) -> Measurement:
    """In the forked process: the method's times and how far its RSS grew.

    Every method starts with the objects inherited at fork frozen, as a rank of the app does
    (``app.launch.rank.run_rank`` calls ``gc.freeze()`` after its imports)."""
    gc.freeze()
    before = _rss_mib()
    result = METHODS[method](world, rank)
    result["peak_rss_mib"] = _peak_rss_mib()
    result["rss_growth_mib"] = result["peak_rss_mib"] - before
    return result


def run(settings: Settings) -> list[Row]:
    worlds = (1024, 65536) if settings.quick else (1024, 8192, 65536)
    reps = settings.reps(5, 3)
    rows: list[Row] = []
    for world in worlds:
        for rank in (0, world - 1):
            runs: dict[str, list[Measurement]] = {m: [] for m in METHODS}
            for rep in range(reps):
                order = list(METHODS) if rep % 2 == 0 else list(METHODS)[::-1]
                for method in order:
                    runs[method].append(run_forked(_measure, method, world, rank, timeout=600))
            rows += _rows(world, rank, runs)
    return rows


def _series(runs: dict[str, list[Measurement]], key: str, less: str = "") -> dict[str, list[float]]:
    """Per method, ``key`` of every repetition (minus ``less`` when given)."""
    return {
        method: [m[key] - (m[less] if less else 0.0) for m in measured]
        for method, measured in runs.items()
    }


def _gc_note(runs: dict[str, list[Measurement]], key: str) -> str:
    gc_median = {m: Stat.of(v).median for m, v in _series(runs, f"{key}_gc").items()}
    return "GC in it: " + ", ".join(f"{m} {v * 1e3:.0f} ms" for m, v in gc_median.items())


def _rows(world: int, rank: int, runs: dict[str, list[Measurement]]) -> list[Row]:
    who = f"W={world:,} rank {rank} ({'trainer' if rank % 2 == 0 else 'rollout'})"
    rows = []
    if rank == 0:  # the planner does not depend on the rank
        rows.append(
            compare(
                NAME,
                f"W={world:,} planner (plan+validate) vs rank lists alone",
                _series(runs, "lists"),
                "rlcomm",
                "raw",
                PLANNER_GOAL if world == 65536 else None,
                note=_gc_note(runs, "lists"),
            )
        )
    rows.append(
        compare(
            NAME,
            f"{who} create groups vs new_group loop",
            _series(runs, "create"),
            "rlcomm",
            "raw",
            CREATE_GOAL,
            note=_gc_note(runs, "create"),
        )
    )
    rows.append(
        compare(
            NAME,
            f"{who} create groups vs new_group loop, GC time excluded",
            _series(runs, "create", less="create_gc"),
            "rlcomm",
            "raw",
        )
    )
    total = _series(runs, "total")
    note = _gc_note(runs, "total")
    for reference, what in (("raw", "lists+init+new_group"), ("device_mesh", "init_device_mesh")):
        rows.append(
            compare(
                NAME, f"{who} plan+init+create vs {what}", total, "rlcomm", reference, note=note
            )
        )
    growth = _series(runs, "rss_growth_mib")
    peak = {m: Stat.of(v).median for m, v in _series(runs, "peak_rss_mib").items()}
    row = compare(
        NAME,
        f"{who} peak RSS growth vs raw loop",
        {m: [v * 2**20 for v in values] for m, values in growth.items()},
        "rlcomm",
        "raw",
        unit=BYTES,
        note="peak RSS (MiB): " + ", ".join(f"{m} {v:.0f}" for m, v in peak.items()),
    )
    row.extra["peak_rss_mib"] = peak
    rows.append(row)
    return rows
