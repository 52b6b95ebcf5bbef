"""The run's shape for tests that build a rank's parts themselves: as the launcher derives it
(app/launch/shape.py) for the RL runtime's loop on a plan, never written by hand."""

from __future__ import annotations

from typing import Any

from app.api import RunShape
from app.launch.shape import Asked, derive_shape
from rlcomm import LayoutPlan


def shape_of(plan: LayoutPlan, data_parallel: str = "ddp", *, loop: Any = None,
             elastic_rollouts: bool | None = None,
             elastic_trainers: bool | None = False) -> RunShape:
    """The shape of PPO (or ``loop``) on ``plan``: rollout ranks elastic as the plan was
    declared (``elastic_rollouts`` None) or as asked; trainers static unless asked
    (``elastic_trainers`` None: where they can be, the launcher's default)."""
    if loop is None:
        from app.loops.ppo import PPOLoop

        loop = PPOLoop(data_parallel=data_parallel)
    rollouts = plan.elastic_rollouts if elastic_rollouts is None else elastic_rollouts
    return derive_shape(plan, loop, Asked(elastic_rollouts=rollouts,
                                          elastic_trainers=elastic_trainers))
