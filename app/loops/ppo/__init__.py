"""Distributed PPO on CartPole: rollout ranks step envs, trainer ranks update with DDP.

Per update:
  1. rollout ranks collect a trajectory segment with the newest weights they hold and gather it,
     tagged with that weights version, to their trainer as one tensor (WEIGHT_TRANSFER);
  2. finished episodes are all-gathered (GLOBAL), so every rank takes the same stop decision;
  3. trainers check the segments' staleness and run PPO epochs; DDP averages gradients over
     TRAIN_DATA_PARALLEL; each trainer then sends the new weights to its rollout ranks
     (zero-copy: the policy lives in the send buffer) without waiting for delivery;
  4. rollout ranks post the receive of those weights into a spare buffer and wait for it only
     when the weights they hold would be more than ``max_staleness`` versions behind the ones
     their next segment will be trained with. With ``max_staleness=0`` every step waits: the
     lockstep loop. With ``1`` the rollouts collect the next segment while the trainers update.
With no rollout ranks (``layout=single``) each trainer collects for itself and nothing is sent.

The modules, in the order a run uses them: this one (the settings, checked before any rank
starts), ``run.py`` (one rank's loop), ``core.py`` (the PPO maths, no ``torch.distributed``),
``exchange.py`` (what moves between trainers and rollouts), ``records.py`` (metrics.csv,
TensorBoard, the job's figures, learning_curve.png) and ``checkpoints.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from app.api import ConfigError, JobInfo, LoopMetrics, setting
from app.loops.ppo.checkpoints import (
    CHECKPOINT_DIR,
    env_spaces,
    newest_valid_checkpoint,
    policy_shapes,
    resume_mismatch,
    run_settings,
)
from app.loops.ppo.core import MAX_RETURN, PPOHyperParams
from app.loops.ppo.exchange import StaleDataError, check_staleness, policy_receiver
from app.loops.ppo.run import PPORun
from app.output.logs import write_console
from app.output.progress import StopRule
from app.output.tensorboard import SUBDIR, check_tensorboard
from rlcomm import CommContext, LayoutPlan

__all__ = ["PPOLoop", "StaleDataError", "check_staleness", "policy_receiver"]


@dataclass
class PPOLoop:
    total_env_steps: int = setting(400_000, "budget: stop here if the target is not reached")
    target_return: float = setting(475.0, "stop once the mean return of the last `window` episodes reaches it")
    window: int = setting(20, "episodes in the stop rule's mean return")
    checkpoint_every: int = setting(10, "updates between checkpoints; 0 disables them")
    resume: str | None = setting(None, "a checkpoint file, or a run dir holding checkpoints/ (its newest valid one)")
    progress: bool = setting(True, "rank 0's progress line: a bar on a terminal, plain lines otherwise")
    tensorboard: bool = setting(False, "TensorBoard scalars under <run dir>/tensorboard (the tensorboard extra)")
    hparams: PPOHyperParams = setting(doc="PPO hyperparameters", factory=PPOHyperParams)
    max_staleness: int = setting(
        0, "weights versions a trainer's data may lag its own (0: lockstep; >= 1: rollouts "
        "collect while trainers update)"
    )
    verify_weights_every: int = setting(
        10, "every N-th weights version, rollouts check what they loaded against the "
        "trainer's bytes (0: never)"
    )

    # What the run reports in result["metrics"] (records.job_metrics), for sweeps to rank by:
    # the same on every rank; after a resume, rates and times cover this attempt only.
    metrics: ClassVar[LoopMetrics] = LoopMetrics(
        {
            "env_steps_per_s": "max",
            "time_to_target_s": "min",  # None when the target return was not reached
            "env_steps_to_target": "min",  # None when the target return was not reached
            "reached_target": "max",  # 1 or 0
            "updates_per_s": "max",
            "transfer_s": "min",  # weight-transfer time per trainer
            "transfer_share": "min",  # weight-transfer time / trainer loop time
            "trainer_wait_fraction": "min",  # trainers blocked on rollouts' trajectories
            "rollout_wait_fraction": "min",  # rollouts blocked on trainers (weights, hand-off)
            "final_mean_return": "max",
        },
        headline=("time_to_target_s", "env_steps_to_target", "env_steps_per_s",
                  "transfer_share", "trainer_wait_fraction", "rollout_wait_fraction"),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.hparams, PPOHyperParams):  # built from a plain mapping
            self.hparams = PPOHyperParams(**dict(self.hparams))
        self.hp = self.hparams

    def validate(self, plan: LayoutPlan) -> None:
        """Range checks, run by the launcher before any rank starts."""
        collectors = len(plan.rollouts) if plan.rollouts else len(plan.trainers)
        per_update = collectors * self.hp.num_envs * self.hp.num_steps
        batch_per_trainer = per_update // len(plan.trainers)
        errors = [f"hparams.{e}" for e in self.hp.range_errors(batch_per_trainer)]
        if self.window < 1:
            errors.append(f"window: must be a positive integer, got {self.window}")
        if self.checkpoint_every < 0:
            errors.append(f"checkpoint_every: must be >= 0, got {self.checkpoint_every}")
        if self.max_staleness < 0:
            errors.append(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.verify_weights_every < 0:
            errors.append(f"verify_weights_every: must be >= 0, got {self.verify_weights_every}")
        if not errors and self.total_env_steps < per_update:
            errors.append(
                f"total_env_steps: must allow at least one update ({per_update} env steps with "
                f"this layout and hparams), got {self.total_env_steps}"
            )
        if errors:
            raise ConfigError(f"loop.{errors[0]}")
        self.check_resume()
        if self.tensorboard:
            check_tensorboard()

    def check_resume(self) -> None:
        """``loop.resume``, resolved and checked in the launcher before any rank starts: the
        checkpoint the ranks will pick (a folder's newest valid one; skipped files and an
        unverifiable old checkpoint are named in a warning line) must verify and agree with
        this run's algorithm, environment, hyperparameters and policy shapes
        (docs/data-safety.md, "Resume is checked before launch")."""
        if self.resume is None:
            return
        picked = newest_valid_checkpoint(self.resume)
        for note in picked.notes():
            write_console(f"warning: {note}")
        observation_space, action_space = env_spaces()
        problem = resume_mismatch(
            picked.state,
            run_settings(self, observation_space, action_space),
            policy_shapes(self.hp.hidden_size, observation_space, action_space),
        )
        if problem:
            raise ConfigError(problem)

    def stop_rule(self) -> StopRule:
        """What ends a run: the target when an episode can reach it, else the budget alone."""
        reachable = self.target_return <= MAX_RETURN
        return StopRule(self.target_return if reachable else None, self.window,
                        self.total_env_steps)

    def summary(self, result: dict[str, Any], run_dir: Path) -> dict[str, Any]:
        """The closing summary's figures and files, from rank 0's result."""
        final = result["mean_return_last_window"]
        return {
            "solved": result["reached_target"],
            "target_return": self.target_return,
            "window": self.window,
            "time_to_target_s": result["time_to_target_s"],
            "env_steps_to_target": result["env_steps_to_target"],
            "final_mean_return": final if np.isfinite(final) else None,
            "env_steps": result["env_steps"],
            "updates": result["updates"],
            "train_wall_s": result["wall_s"],
            # As the sweep compares jobs (result["metrics"]): this attempt's rate, all trainers'
            # share of their time spent sending weights.
            "env_steps_per_s": result["metrics"]["env_steps_per_s"],
            "transfer_share": result["metrics"]["transfer_share"],
            "files": {
                name: str(run_dir / name)
                for name in ("metrics.csv", "learning_curve.png", CHECKPOINT_DIR, SUBDIR)
                if (run_dir / name).exists()
            },
        }

    def __call__(self, ctx: CommContext, job: JobInfo) -> dict[str, Any]:
        return PPORun(self, ctx, job).run()
