"""The runtime's loop: its settings (app/runtime/settings.py) and the entry every rank calls.
An algorithm becomes a loop by subclassing :class:`RLLoop` with its settings as ``hparams`` and
itself as ``algorithm`` (this is app/loops/ppo/__init__.py's)::

    from dataclasses import dataclass
    from typing import Any, ClassVar

    from app.api import setting
    from app.loops.ppo.core import PPO, PPOSettings
    from app.runtime import Algorithm, RLLoop

    @dataclass
    class PPOLoop(RLLoop):
        hparams: PPOSettings = setting(doc="PPO settings", factory=PPOSettings)
        algorithm: ClassVar[type[Algorithm[Any]]] = PPO

Such a loop follows membership epochs (its rollout ranks may leave and join, as
``layout.elastic_rollouts`` allows) unless it sets ``elastic_rollouts`` to False.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.api import JobInfo
from app.runtime.membership.reports import reporting_ranks
from app.runtime.run import run_rank
from app.runtime.settings import RunSettings
from rlcomm import CommContext, LayoutPlan


@dataclass
class RLLoop(RunSettings):
    """A loop on the RL runtime: its settings, and one rank's run of them."""

    def __call__(self, ctx: CommContext, job: JobInfo) -> dict[str, Any]:
        return run_rank(self, ctx, job)

    def reporting_ranks(self, ctx: CommContext, plan: LayoutPlan,
                        timeout_s: float) -> list[int]:
        """Who reports at the end of an elastic run (app/runtime/membership/reports.py)."""
        return reporting_ranks(ctx, plan, timeout_s)
