"""commcheck: exercise every group this rank belongs to and report what it measured.

The command to run on a new cluster (in the spirit of nccl-tests): known values through
all_reduce, broadcast and all_gather must come back exact, then a small all_reduce gives the
latency and a large broadcast the bandwidth of each group.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from app.api import JobInfo, LoopMetrics, setting
from rlcomm import CommContext, CommMode, LayoutPlan, collectives
from rlcomm.utils import format_ranks

from ..errors import ConfigError


class CommCheckError(AssertionError):
    pass


@dataclass
class CommCheck:
    latency_iters: int = setting(20, "small all_reduces timed per group (median reported)")
    bandwidth_bytes: int = setting(4 * 1024 * 1024, "bytes broadcast per bandwidth measurement")
    bandwidth_iters: int = setting(3, "broadcasts timed per group (median reported)")

    # What group_metrics reports, for sweeps to rank by.
    metrics: ClassVar[LoopMetrics] = LoopMetrics(
        {
            "latency_us": "min",  # per group, as "latency_us:<group>"
            "bandwidth_gbps": "max",  # per group, as "bandwidth_gbps:<group>"
            "max_latency_us": "min",  # the slowest group's all_reduce latency
            "min_bandwidth_gbps": "max",  # the slowest group's broadcast bandwidth
        },
        headline=("max_latency_us", "min_bandwidth_gbps"),
    )

    def validate(self, plan: LayoutPlan) -> None:
        for name in ("latency_iters", "bandwidth_bytes", "bandwidth_iters"):
            if getattr(self, name) < 1:
                raise ConfigError(f"loop.{name}: must be a positive integer, got {getattr(self, name)}")

    def __call__(self, ctx: CommContext, job: JobInfo) -> dict[str, Any]:
        report: dict[str, Any] = {}
        for mode, info in ctx.describe().items():
            self._check(ctx, mode, info.ranks)
            report[mode] = {
                "ranks": info.ranks,
                "checks": "passed",
                "allreduce_latency_us": self._latency_us(ctx, mode),
                "broadcast_gbps": self._bandwidth_gbps(ctx, mode),
            }
        everyone = collectives.gather_json(ctx, CommMode.GLOBAL, report, dst=0)
        report["metrics"] = group_metrics(everyone) if everyone is not None else {}
        if everyone is not None:
            report["slowest_group"] = slowest_group(report["metrics"])
        return report

    def _check(self, ctx: CommContext, mode: str, ranks: list[int]) -> None:
        device = ctx.get_device(mode)
        me = ctx.get_global_rank()
        total = collectives.all_reduce(ctx, mode, torch.tensor([float(me)], device=device))
        _expect(mode, "all_reduce", total.item(), float(sum(ranks)))
        leader = ctx.get_declared_ranks(mode)[0]
        got = collectives.broadcast(ctx, mode, torch.tensor([me], device=device))
        _expect(mode, "broadcast", got.item(), leader)
        gathered = collectives.all_gather(ctx, mode, torch.tensor([me], device=device))
        _expect(mode, "all_gather", gathered.tolist(), ranks)

    def _latency_us(self, ctx: CommContext, mode: str) -> float:
        tensor = torch.zeros(1, device=ctx.get_device(mode))
        collectives.all_reduce(ctx, mode, tensor)  # warm-up
        times = []
        for _ in range(self.latency_iters):
            start = time.perf_counter()
            collectives.all_reduce(ctx, mode, tensor)
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) * 1e6, 1)

    def _bandwidth_gbps(self, ctx: CommContext, mode: str) -> float:
        device = ctx.get_device(mode)
        payload = torch.empty(self.bandwidth_bytes, dtype=torch.uint8, device=device)
        collectives.broadcast(ctx, mode, payload)
        times = []
        for _ in range(self.bandwidth_iters):
            collectives.barrier(ctx, mode)
            start = time.perf_counter()
            collectives.broadcast(ctx, mode, payload)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return round(self.bandwidth_bytes / statistics.median(times) / 1e9, 3)


def group_metrics(reports: list[dict[str, Any]]) -> dict[str, float]:
    """Per group, as its slowest member measured it (``latency_us:<MODE>[ranks]``,
    ``bandwidth_gbps:<MODE>[ranks]``), and the slowest group of the job."""
    latency: dict[str, float] = {}
    bandwidth: dict[str, float] = {}
    for report in reports:
        for mode, figures in report.items():
            group = f"{mode}{format_ranks(figures['ranks'])}"
            latency[group] = max(latency.get(group, 0.0), figures["allreduce_latency_us"])
            bandwidth[group] = min(bandwidth.get(group, float("inf")), figures["broadcast_gbps"])
    metrics = {f"latency_us:{g}": v for g, v in latency.items()}
    metrics |= {f"bandwidth_gbps:{g}": v for g, v in bandwidth.items()}
    metrics["max_latency_us"] = max(latency.values())
    metrics["min_bandwidth_gbps"] = min(bandwidth.values())
    return metrics


def slowest_group(metrics: dict[str, float]) -> str:
    """The group with the highest latency, e.g. ``WEIGHT_TRANSFER[0,2]``."""
    worst = max((k for k in metrics if k.startswith("latency_us:")), key=metrics.__getitem__)
    return worst.split(":", 1)[1]


def _expect(mode: str, what: str, got: Any, want: Any) -> None:
    if got != want:
        raise CommCheckError(f"{mode}: {what} returned {got}, expected {want}")
