"""The runtime's loop: its settings (app/runtime/settings.py), the loop's hooks the launcher
calls on them (their checks, app/runtime/validation.py; the closing summary,
app/runtime/builders.py) and the entry every rank calls.

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
from pathlib import Path
from typing import Any

from app.api import JobInfo
from app.runtime import validation
from app.runtime.builders import run_summary
from app.runtime.membership.reports import reporting_ranks
from app.runtime.run import run_rank
from app.runtime.settings import RunSettings
from rlcomm import CommContext, LayoutPlan


@dataclass
class RLLoop(RunSettings):
    """A loop on the RL runtime: its settings, the hooks of the loop contract (app.api.Loop) on
    them, and one rank's run of them."""

    def __call__(self, ctx: CommContext, job: JobInfo) -> dict[str, Any]:
        return run_rank(self, ctx, job)

    def validate(self, plan: LayoutPlan) -> None:
        """Range checks and the environment's, run by the launcher before any rank starts."""
        self.validate_settings(plan)
        validation.check_env(self, plan)

    def validate_settings(self, plan: LayoutPlan) -> None:
        """The checks of :meth:`validate` that build nothing (no env, no policy): all that a
        rank of a joined run other than rank 0 runs (app/launch/rank.py)."""
        validation.check_settings(self, plan)

    def check_seed(self, seed: int, plan: LayoutPlan) -> None:
        """The top-level ``seed`` against the seeds every rank derives from it
        (app/runtime/seeds.py), run by the launcher after :meth:`validate`."""
        validation.check_seed(self, seed, plan)

    def summary(self, result: dict[str, Any], run_dir: Path) -> dict[str, Any]:
        """The closing summary's figures and files, from rank 0's result."""
        return run_summary(self, result, run_dir)

    def reporting_ranks(self, ctx: CommContext, plan: LayoutPlan,
                        timeout_s: float) -> list[int]:
        """Who reports at the end of an elastic run (app/runtime/membership/reports.py)."""
        return reporting_ranks(ctx, plan, timeout_s)
