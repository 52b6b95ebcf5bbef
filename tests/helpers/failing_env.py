"""An environment that fails mid-run on one rank: CartPole that raises after a number of steps
in the process whose ``RANK`` is ``fail_rank`` (the launcher's probe, with no RANK, is spared;
the default ``fail_rank`` spares every process)."""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym


class FailingCartPole(gym.Wrapper[Any, Any, Any, Any]):
    def __init__(self, fail_rank: int, after_steps: int) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.fails = os.environ.get("RANK") == str(fail_rank)
        self.after_steps, self.steps = after_steps, 0

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.fails and self.steps > self.after_steps:
            raise RuntimeError(f"simulated fault after {self.after_steps} steps")
        return self.env.step(action)


def make_failing_env(fail_rank: int = -1, after_steps: int = 0) -> gym.Env[Any, Any]:
    return FailingCartPole(fail_rank, after_steps)
