"""The agent the hand-off tests publish and receive (tests/integration/test_handoff.py,
test_elastic_sharded_handoff.py): a transformer policy under ``net``, statistics beside it."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from app.runtime.envs import EnvConfig, probe_spaces
from app.runtime.transformer import TransformerActorCritic

ENV = EnvConfig(id="MaskedCartPole-v1", _target_="app.runtime.memory_envs.masked_cartpole")


class Acting(nn.Module):
    """An agent as the runtime's: the policy under ``net`` and statistics beside it."""

    stats: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.net = TransformerActorCritic(probe_spaces(ENV), width=32, layers=2, heads=4,
                                          context=4)
        self.register_buffer("stats", torch.zeros(3, dtype=torch.float64))


def state_values(agent: nn.Module) -> dict[str, np.ndarray]:
    """The agent's state by value (a tensor returned from a rank would be shared memory)."""
    return {k: v.detach().clone().numpy() for k, v in agent.state_dict().items()}
