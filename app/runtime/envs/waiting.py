"""An environment whose step waits: ``WaitingCartPole-v1`` is CartPole-v1 whose every step (and
reset) first waits ``latency_s`` seconds (2 ms by default), as a step of a remote simulator or a
robot does. The time is spent waiting, not computing: on a machine with few cores, more rollout
ranks then step more environments per second, until the trainers are the bound, which a
CPU-bound environment cannot show (docs/environments.md).

Importing this module registers it; :func:`register_waiting_envs` does it explicitly.
``loop.env.id=WaitingCartPole-v1 +loop.env.kwargs.latency_s=0.005`` picks another latency.
"""

from __future__ import annotations

import math
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

__all__ = ["WAITING_CARTPOLE_ID", "Waiting", "register_waiting_envs"]

WAITING_CARTPOLE_ID = "WaitingCartPole-v1"
DEFAULT_LATENCY_S = 0.002


class Waiting(gym.Wrapper[np.ndarray, Any, np.ndarray, Any]):
    """Waits ``latency_s`` seconds before each step and reset of ``env``."""

    def __init__(self, env: gym.Env[np.ndarray, Any], latency_s: float = DEFAULT_LATENCY_S) -> None:
        if not (latency_s >= 0 and math.isfinite(latency_s)):
            raise ValueError(f"latency_s: must be a number of seconds >= 0, got {latency_s}")
        super().__init__(env)
        self.latency_s = float(latency_s)

    def step(self, action: Any) -> Any:
        time.sleep(self.latency_s)
        return self.env.step(action)

    def reset(self, **kwargs: Any) -> Any:
        time.sleep(self.latency_s)
        return self.env.reset(**kwargs)


def _waiting_cartpole_env(latency_s: float = DEFAULT_LATENCY_S,
                          **kwargs: Any) -> gym.Env[np.ndarray, Any]:
    """The registered entry point: gym.make adds the time limit and the usual wrappers."""
    return Waiting(CartPoleEnv(**kwargs), latency_s)


def register_waiting_envs() -> None:
    """Register ``WaitingCartPole-v1`` with Gymnasium (again is a no-op)."""
    if WAITING_CARTPOLE_ID not in gym.registry:
        gym.register(
            id=WAITING_CARTPOLE_ID,
            entry_point=f"{__name__}:_waiting_cartpole_env",
            reward_threshold=475.0,
            max_episode_steps=500,
        )


register_waiting_envs()
