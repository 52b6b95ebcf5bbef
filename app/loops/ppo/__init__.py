"""Distributed PPO on the runtime (app/runtime/): the default loop.

Per update:
  1. collectors (rollout ranks, or every trainer when colocated) step their envs with the newest
     weights they hold and hand the segment, tagged with that weights version, to their trainer;
  2. trainers check the segments' staleness and run PPO epochs; DDP averages gradients over
     TRAIN_DATA_PARALLEL; each trainer then sends the new weights to its rollout ranks;
  3. with ``loop.max_staleness=0`` rollouts wait for those weights (lockstep); with ``1`` they
     collect the next segment while the trainers update, and the update is decoupled PPO.
All of that is the runtime's; this package holds only PPO itself (``core.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from app.api import setting
from app.loops.ppo.core import PPO, PPOSettings
from app.runtime import Algorithm, RLLoop
from app.runtime.handoff.base import StaleDataError, check_staleness
from app.runtime.handoff.weights import policy_receiver

__all__ = ["PPOLoop", "StaleDataError", "check_staleness", "policy_receiver"]


@dataclass
class PPOLoop(RLLoop):
    hparams: PPOSettings = setting(doc="PPO settings", factory=PPOSettings)
    algorithm: ClassVar[type[Algorithm[Any]]] = PPO
