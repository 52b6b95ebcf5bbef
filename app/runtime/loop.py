"""The runtime's loop: its settings (app/runtime/settings/schema.py), the loop's hooks the launcher
calls on them (their checks, app/runtime/validation.py; the closing summary,
app/runtime/settings/builders.py) and the entry every rank calls.

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
``layout.elastic_rollouts`` allows) unless it sets ``elastic_rollouts`` to False. An
off-policy algorithm's loop is an :class:`OffPolicyLoop`: the runtime's settings and
``loop.replay``.
"""

from __future__ import annotations

import logging
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from app.api import ConfigError, JobInfo, LoopMetrics, setting
from app.runtime.core.algorithm import Algorithm, Spaces
from app.runtime.core.replay_api import ReplaySettings
from app.runtime.membership.reports import reporting_ranks
from app.runtime.replay.offpolicy import transition_bytes
from app.runtime.run import run_rank
from app.runtime.settings import RunSettings, plain
from app.runtime.settings.builders import cadence, run_summary
from app.runtime.validation import check_env, check_seed, check_settings
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
        check_env(self, plan)

    def validate_settings(self, plan: LayoutPlan) -> None:
        """The checks of :meth:`validate` that build nothing (no env, no policy): all that a
        rank of a joined run other than rank 0 runs (app/launch/rank.py)."""
        check_settings(self, plan)

    def check_seed(self, seed: int, plan: LayoutPlan) -> None:
        """The top-level ``seed`` against the seeds every rank derives from it
        (app/runtime/core/seeds.py), run by the launcher after :meth:`validate`."""
        check_seed(self, seed, plan)

    def summary(self, result: dict[str, Any], run_dir: Path) -> dict[str, Any]:
        """The closing summary's figures and files, from rank 0's result."""
        return run_summary(self, result, run_dir)

    def reporting_ranks(self, ctx: CommContext, plan: LayoutPlan,
                        timeout_s: float) -> list[int]:
        """Who reports at the end of an elastic run (app/runtime/membership/reports.py)."""
        return reporting_ranks(ctx, plan, timeout_s)


@dataclass
class OffPolicyLoop(RLLoop):
    """An RL loop whose algorithm learns from a replay: the runtime's settings, ``hparams``, and
    ``replay`` (``loop.replay``, checked before launch)."""

    replay: ReplaySettings = setting(doc="the replay shard and its rate limiter (docs/off-policy.md)",
                                     factory=ReplaySettings)
    # The runtime's figures plus, for a sweep to compare, the seconds each side waited on the
    # limiter (this attempt's totals, as the last update left them).
    metrics: ClassVar[LoopMetrics] = LoopMetrics(
        {**RLLoop.metrics.directions, "collector_wait_s": "min", "learner_wait_s": "min"},
        headline=RLLoop.metrics.headline)
    # layout.replay may hold this loop's replay (app/launch/shape.py checks it); its trainers
    # are DDP ones, never sharded (refused there too).
    replay_ranks_supported: ClassVar[bool] = True
    sharded_trainers: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.replay, ReplaySettings):
            self.replay = typing.get_type_hints(type(self))["replay"](**plain(self.replay))

    def validate_settings(self, plan: LayoutPlan) -> None:
        """The runtime's checks that build nothing, then the replay's (``loop.replay.<field>:
        ...``), its share of a batch per replay rank, and the policy it acts with. Its trainers
        are DDP ones (``sharded_trainers``: refused with the run's shape, app/launch/shape.py),
        since its update (each trainer's batch from its own replay shard, one gradient step
        through the DDP model) has no sharded form."""
        super().validate_settings(plan)
        shards = len(plan.replay) or len(plan.trainers)
        errors = self.replay.range_errors(self.hparams.num_steps, shards)
        if errors:
            raise ConfigError(f"loop.{errors[0]}")
        ranks = list(plan.replay)
        if self.replay.batch_size < len(ranks):  # every replay rank gives a share of each batch
            raise ConfigError(
                f"loop.replay.batch_size: {self.replay.batch_size} is fewer than the "
                f"{len(ranks)} replay ranks {ranks}, which each give a share of every batch; use "
                f"at least {len(ranks)}")
        if self.model.kind != "mlp":
            raise ConfigError(f"loop.model.kind: {self.model.kind}, but an off-policy loop acts "
                              "with its algorithm's own network; use loop.model.kind=mlp")

    def validate(self, plan: LayoutPlan) -> None:
        """:meth:`validate_settings` and the runtime's checks that build (the env's), then what
        a replay checkpoint would hold."""
        super().validate(plan)
        if self.replay.checkpoint:
            self._check_replay_checkpoint(plan, len(plan.replay) or len(plan.trainers))

    def _check_replay_checkpoint(self, plan: LayoutPlan, shards: int) -> None:
        """``loop.replay.checkpoint``: checkpoints on, the replay on the trainers; its size is
        said at launch (the start lines)."""
        if not cadence(self).on:
            raise ConfigError("loop.replay.checkpoint: true, but checkpoints are off "
                              "(loop.checkpoint_every=0)")
        per = transition_bytes(self.spaces)
        total = shards * self.replay.capacity * per
        logging.getLogger("app").info(
            "loop.replay.checkpoint: up to %.1f MB beside each checkpoint (%d shard%s x %d "
            "transitions x %d bytes)", total / 1e6, shards, "s" if shards > 1 else "",
            self.replay.capacity, per)

    def build_algorithm(self, spaces: Spaces) -> Algorithm[Any]:
        algorithm_cls: Any = self.algorithm  # an OffPolicyAlgorithm: it takes the replay too
        algorithm: Algorithm[Any] = algorithm_cls(self.hparams, spaces, replay=self.replay)
        algorithm.compile_mode = self.compile
        return algorithm
