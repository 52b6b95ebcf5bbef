"""DQN on the runtime (``python -m app loop=dqn``): discrete actions, a replay per trainer,
a target network, epsilon-greedy collectors, optionally double DQN and prioritized replay.

The maths is in ``core.py`` (no ``torch.distributed``); the replay, the rate limiter and the
update are app/runtime/replay/offpolicy.py's, everything else the runtime's (docs/off-policy.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from app.api import setting
from app.loops.dqn.core import (
    DQN,
    DQNSettings,
    QNetwork,
    apex_epsilon,
    dqn_targets,
    epsilon_at,
)
from app.runtime import Algorithm
from app.runtime.loop import OffPolicyLoop
from app.runtime.replay.buffer import ReplaySettings

__all__ = ["DQN", "DQNLoop", "DQNSettings", "QNetwork", "apex_epsilon", "dqn_replay", "dqn_targets",
           "epsilon_at"]


def dqn_replay() -> ReplaySettings:
    """DQN's replay, tuned for CartPole-v1 (docs/off-policy.md): a 50,000 buffer, batches of
    64, learning from 1,000 transitions (CleanRL dqn.py: 10,000, 128, 10,000), 8 samples per
    insert (CleanRL: 12.8) and 3-step returns."""
    return ReplaySettings(capacity=50_000, batch_size=64, min_size=1_000, samples_per_insert=8.0,
                          tolerance=64.0, n_step=3, prioritized=False)


@dataclass
class DQNLoop(OffPolicyLoop):
    """The runtime's settings plus DQN's (``loop.hparams``) and its replay (``loop.replay``)."""

    hparams: DQNSettings = setting(doc="DQN settings", factory=DQNSettings)
    replay: ReplaySettings = setting(doc="the replay shard and its rate limiter "
                                     "(docs/off-policy.md)", factory=dqn_replay)
    algorithm: ClassVar[type[Algorithm[Any]]] = DQN
