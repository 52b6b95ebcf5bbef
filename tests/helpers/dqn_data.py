"""A small DQN problem for unit tests of the replay and off-policy checkpoints: its spaces, a
replay that learns after 16 transitions, and random segments of it."""

from __future__ import annotations

import torch
from gymnasium import spaces as gym_spaces

from app.runtime import Spaces
from app.runtime.core.algorithm import Segment
from app.runtime.replay.buffer import ReplaySettings

SPACES = Spaces(gym_spaces.Box(-1, 1, (4,)), gym_spaces.Discrete(2))
REPLAY = ReplaySettings(capacity=64, batch_size=8, min_size=16, samples_per_insert=1.0,
                        tolerance=8.0)


def segment(steps: int = 4, envs: int = 4) -> Segment:
    """``steps`` x ``envs`` random transitions of :data:`SPACES`, every reward 1."""
    return Segment(obs=torch.randn(steps, envs, 4), actions=torch.randint(2, (steps, envs)),
                   rewards=torch.ones(steps, envs), dones=torch.zeros(steps, envs),
                   next_obs=torch.randn(envs, 4), next_done=torch.zeros(envs))
