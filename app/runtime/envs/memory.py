"""Tasks that need memory: a policy that sees only the current observation cannot solve them.

``MaskedCartPole-v1`` is CartPole-v1 without the velocities: the observation is the cart's
position and the pole's angle (indices 0 and 2), so the velocities must be inferred from past
steps. Importing this module registers it (so ``gym.make("app.runtime.envs.memory:
MaskedCartPole-v1")`` works as it is); :func:`register_memory_envs` does it explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces as gym_spaces
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

__all__ = [
    "MASKED_CARTPOLE_ID",
    "KeepObservation",
    "masked_cartpole",
    "register_memory_envs",
]

MASKED_CARTPOLE_ID = "MaskedCartPole-v1"
_CARTPOLE_POSITIONS = (0, 2)  # cart position, pole angle; 1 and 3 are their velocities


class KeepObservation(gym.ObservationWrapper[np.ndarray, Any, np.ndarray]):
    """Keeps only the features at ``indices`` of a 1-D Box observation."""

    def __init__(self, env: gym.Env[np.ndarray, Any], indices: Sequence[int]) -> None:
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, gym_spaces.Box) or len(space.shape) != 1:
            raise ValueError(f"KeepObservation needs a 1-D Box observation space, got {space}")
        self.indices = np.asarray(indices, dtype=np.int64)
        self.observation_space = gym_spaces.Box(
            space.low[self.indices], space.high[self.indices], dtype=space.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[self.indices]


def _masked_cartpole_env(**kwargs: Any) -> gym.Env[np.ndarray, Any]:
    """The registered entry point: gym.make adds the time limit and the usual wrappers."""
    return KeepObservation(CartPoleEnv(**kwargs), _CARTPOLE_POSITIONS)


def register_memory_envs() -> None:
    """Register ``MaskedCartPole-v1`` with Gymnasium (again is a no-op)."""
    if MASKED_CARTPOLE_ID not in gym.registry:
        gym.register(
            id=MASKED_CARTPOLE_ID,
            entry_point=f"{__name__}:_masked_cartpole_env",
            reward_threshold=475.0,
            max_episode_steps=500,
        )


def masked_cartpole(**kwargs: Any) -> gym.Env[Any, Any]:
    """``MaskedCartPole-v1`` (``gym.make`` with ``kwargs``, e.g. ``render_mode``): CartPole-v1
    whose observations are Box (2,), position and angle only. Usable as ``loop.env._target_``."""
    register_memory_envs()
    return gym.make(MASKED_CARTPOLE_ID, **kwargs)


register_memory_envs()
