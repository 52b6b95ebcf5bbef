"""A small transformer policy and random inputs for it, for the transformer tests
(tests/unit/test_transformer.py, tests/integration/test_transformer.py)."""

from __future__ import annotations

import numpy as np
import torch
from gymnasium import spaces as gym_spaces
from torch import Tensor

from app.runtime.core.algorithm import Spaces
from app.runtime.models.transformer import TransformerActorCritic

OBS_DIM, CONTEXT, WIDTH, HEADS = 3, 4, 16, 4
DISCRETE = Spaces(gym_spaces.Box(-1.0, 1.0, (OBS_DIM,), np.float32), gym_spaces.Discrete(3))
BOX = Spaces(gym_spaces.Box(-1.0, 1.0, (OBS_DIM,), np.float32),
             gym_spaces.Box(-1.0, 1.0, (2, 2), np.float32))


def make_model(spaces: Spaces, layers: int = 2) -> TransformerActorCritic:
    return TransformerActorCritic(spaces, WIDTH, layers, HEADS, CONTEXT)


def random_windows(*lead: int, seed: int = 0) -> Tensor:
    """Random windows [*lead, CONTEXT, OBS_DIM + 1] whose episodes started 1..CONTEXT steps ago
    (zero padding before, as ObsHistory keeps them)."""
    gen = torch.Generator().manual_seed(seed)
    obs = torch.randn(*lead, CONTEXT, OBS_DIM, generator=gen)
    start = torch.randint(0, CONTEXT, (*lead, 1), generator=gen)
    valid = (torch.arange(CONTEXT) >= start).float()
    return torch.cat([obs * valid[..., None], valid[..., None]], dim=-1)


def random_actions(spaces: Spaces, *lead: int, seed: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    if isinstance(spaces.action, gym_spaces.Discrete):
        return torch.randint(0, int(spaces.action.n), lead, generator=gen)
    return torch.randn(*lead, *spaces.action.shape, generator=gen)


def policy_loss(outputs: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """A PPO-like loss of ``evaluate``'s outputs: every output gets a gradient."""
    logprob, entropy, value = outputs
    return -logprob.mean() - 0.01 * entropy.mean() + 0.5 * value.square().mean()
