"""The collector role: a rank that steps environments (a rollout rank, or a colocated trainer)."""

from __future__ import annotations

import time

from torch import Tensor

from app.runtime.rollout.worker import Agent, Episode, RolloutWorker


class Collector:
    """Collects one segment per update with the agent's current weights, tagged with their
    version (app/runtime/rollout/worker.py); ``split_s``: the rank's time split, which it adds its
    ``collect``, ``env`` and ``act`` seconds to."""

    def __init__(self, worker: RolloutWorker, agent: Agent, split_s: dict[str, float]) -> None:
        self.worker, self.agent, self.split_s = worker, agent, split_s

    def collect(self, version: int) -> tuple[Tensor, list[Episode]]:
        """This update's packed segment and the episodes that finished in it."""
        tick = time.perf_counter()
        own, mine = self.worker.collect(self.agent, version)
        self.split_s["collect"] += time.perf_counter() - tick
        self.split_s["env"], self.split_s["act"] = self.worker.env_s, self.worker.act_s
        return own, mine

    def close(self) -> None:
        self.worker.close()
