"""A small synthetic image env the tests ship: which half is the bright block in?

Each observation is a dark HxWxC uint8 image (36x36x1 by default, the smallest the Nature CNN
takes: 8x8 stride 4, 4x4 stride 2, 3x3 stride 1 leave 1x1) with one bright square somewhere in
its left or right half. Action 0 picks the left half, 1 the right one; reward 1 when right, 0
when wrong; every step shows a new image, and an episode ends (terminated) after 8 steps. So the
best return is 8 and a random policy gets 4 on average; a CNN policy learns it in a few
thousand steps on a CPU. Deterministic given the seed.

Use it as ``loop.env._target_=tests.helpers.image_env.make_image_env`` or, after
:func:`register_image_env`, as ``loop.env.id=RlcommImage-v0``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

ENV_ID = "RlcommImage-v0"
EPISODE_STEPS = 8
# The mean return over the last episodes that counts as learnt (a random policy: 4 of 8).
REWARD_THRESHOLD = 7.5


class ImageSideEnv(gym.Env[np.ndarray, int]):
    """A bright square in the left (action 0) or right (action 1) half of a dark image."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, height: int = 36, width: int = 36, channels: int = 1,
                 episode_steps: int = EPISODE_STEPS, block: int = 8) -> None:
        if width < 2 * block or height < block:
            raise ValueError(f"a {block}-pixel block needs an image of at least {block}x{2 * block}")
        self.height, self.width, self.block = height, width, block
        self.episode_steps = episode_steps
        self.observation_space = spaces.Box(0, 255, (height, width, channels), np.uint8)
        self.action_space = spaces.Discrete(2)
        self._side = 0
        self._t = 0
        self._image = np.zeros((height, width, channels), np.uint8)

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return self._draw(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        reward = float(int(action) == self._side)
        self._t += 1
        return self._draw(), reward, self._t >= self.episode_steps, False, {}

    def _draw(self) -> np.ndarray:
        """A new image with the block in a random half, at a random place inside it."""
        rng, half = self.np_random, self.width // 2
        self._side = int(rng.integers(2))
        row = int(rng.integers(self.height - self.block + 1))
        col = self._side * half + int(rng.integers(half - self.block + 1))
        self._image[:] = 0
        self._image[row:row + self.block, col:col + self.block] = 255
        return self._image.copy()


def make_image_env(**kwargs: Any) -> gym.Env[np.ndarray, int]:
    """The factory for ``loop.env._target_``: an :class:`ImageSideEnv` with ``kwargs``."""
    return ImageSideEnv(**kwargs)


def register_image_env() -> str:
    """Register :class:`ImageSideEnv` as ``RlcommImage-v0`` (once) and return that id."""
    if ENV_ID not in gym.registry:
        gym.register(ENV_ID, entry_point=f"{__name__}:ImageSideEnv",
                     reward_threshold=REWARD_THRESHOLD)
    return ENV_ID


def perfect_action(obs: np.ndarray) -> int:
    """The right answer for one observation: the half holding more brightness."""
    half = obs.shape[1] // 2
    return int(obs[:, half:].sum(dtype=np.int64) > obs[:, :half].sum(dtype=np.int64))
