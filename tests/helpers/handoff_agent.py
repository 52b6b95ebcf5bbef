"""The agent the hand-off tests publish and receive (tests/integration/test_handoff.py,
test_elastic_sharded_handoff.py, test_sharded_handoff_in_place.py): a transformer policy under
``net``, statistics beside it; and the versions a sharded hand-off's tests publish and sync."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.handoff import HandOff
from app.runtime.models.transformer import TransformerActorCritic
from app.runtime.trainer.trained import TrainedModule

ENV = EnvConfig(id="MaskedCartPole-v1", _target_="app.runtime.envs.memory.masked_cartpole")


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


Values = dict[str, np.ndarray]


def sync_versions(hand_off: HandOff, agent: Acting, trained: TrainedModule | None,
                  versions: int, received: Callable[[], None] | None = None,
                  ) -> tuple[dict[int, Values], dict[int, Values]]:
    """Versions 1 .. ``versions`` of the weights through ``hand_off``: a trainer (``trained``)
    makes each as an update does (every shard moved, the statistics too, then published) and
    records what it published; every rank syncs; a rollout rank records what it holds after
    each sync, under the version it holds, then calls ``received``. Returns (what a trainer
    published, what a rollout rank held) by version, after the last sends are done (as the
    next update would wait for them)."""
    sent: dict[int, Values] = {}
    held: dict[int, Values] = {}
    for version in range(1, versions + 1):
        if trained is not None:
            hand_off.before_optimizer_step()
            with torch.no_grad():
                for param in trained.trained.parameters():
                    param.add_(0.01 * version)
                agent.stats.add_(version)
            trained.publish()
            sent[version] = state_values(agent)
        hand_off.sync_weights(first=version == 1)
        if trained is None:
            held[hand_off.version(0)] = state_values(agent)
            if received is not None:
                received()
    hand_off.before_optimizer_step()
    return sent, held
