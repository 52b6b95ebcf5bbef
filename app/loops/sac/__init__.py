"""SAC on the runtime (``python -m app loop=sac``): continuous actions, a replay per trainer,
twin Q-networks with Polyak targets and automatic entropy tuning, CleanRL
``sac_continuous_action.py``'s defaults.

The maths is in ``core.py`` (no ``torch.distributed``); the replay, the rate limiter and the
update are app/runtime/replay/offpolicy.py's, everything else the runtime's (docs/off-policy.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from app.api import setting
from app.loops.sac.core import (
    SAC,
    SACModule,
    SACSettings,
    actor_loss,
    alpha_loss,
    soft_q_targets,
    squashed_log_prob,
)
from app.runtime import Algorithm
from app.runtime.loop import OffPolicyLoop
from app.runtime.replay.buffer import ReplaySettings

__all__ = ["SAC", "SACLoop", "SACModule", "SACSettings", "actor_loss", "alpha_loss",
           "sac_replay", "soft_q_targets", "squashed_log_prob"]


def sac_replay() -> ReplaySettings:
    """CleanRL sac_continuous_action.py's replay: a 1M buffer, batches of 256, learning from
    5,000 transitions, one batch per env step (256 samples per insert), 1-step returns."""
    return ReplaySettings(capacity=1_000_000, batch_size=256, min_size=5_000,
                          samples_per_insert=256.0, tolerance=512.0, n_step=1, prioritized=False)


@dataclass
class SACLoop(OffPolicyLoop):
    """The runtime's settings plus SAC's (``loop.hparams``) and its replay (``loop.replay``)."""

    hparams: SACSettings = setting(doc="SAC settings", factory=SACSettings)
    replay: ReplaySettings = setting(doc="the replay shard and its rate limiter "
                                     "(docs/off-policy.md)", factory=sac_replay)
    algorithm: ClassVar[type[Algorithm[Any]]] = SAC
