"""One rank's PPO run: collect, hand off, train, record, until the stop rule fires.

Every rank runs the same loop; its role decides which steps do work (rollouts collect, trainers
train, colocated ranks do both) and every rank takes part in the same collectives in the same
order (app/loops/ppo/exchange.py). The stop decision is taken from the episodes every rank
shares, so all ranks leave the loop at the same update.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from app.api import JobInfo
from app.loops.ppo.checkpoints import resume_source, run_settings, save_checkpoint
from app.loops.ppo.core import (
    ActorCritic,
    Episode,
    Rollout,
    RolloutWorker,
    make_optimizer,
    ppo_update,
    set_lr,
)
from app.loops.ppo.exchange import Exchange
from app.loops.ppo.records import MetricsFile, job_metrics, plot_learning_curve, update_row
from app.output.progress import RunProgress, Snapshot
from app.output.tensorboard import ScalarLog
from rlcomm import CommContext, ParallelMode

if TYPE_CHECKING:
    from app.loops.ppo import PPOLoop

log = logging.getLogger(__name__)


class PPORun:
    """One rank's state for one run of the loop."""

    def __init__(self, loop: PPOLoop, ctx: CommContext, job: JobInfo) -> None:
        self.loop, self.ctx, self.job, self.hp = loop, ctx, job, loop.hp
        plan = job.plan
        self.rank = ctx.get_global_rank()
        self.is_trainer = self.rank in plan.trainers
        self.collects = plan.colocated or self.rank in plan.rollouts
        self.split = not plan.colocated
        self.collectors = len(plan.trainers) if plan.colocated else len(plan.rollouts)

        # A 64-wide MLP gains nothing from intra-op threads, and on shared cores they spin
        # against each other (layout=single under load: 459 s to the target with 2, 25 s with 1).
        torch.set_num_threads(1)
        torch.manual_seed(job.seed)  # same initial weights on every rank
        self.worker = RolloutWorker.from_hparams(self.hp, seed=job.seed * 10_000 + self.rank)
        obs_dim = self.worker.obs_dim
        num_actions = int(self.worker.envs.single_action_space.n)  # type: ignore[attr-defined]
        self.policy = ActorCritic(obs_dim, num_actions, self.hp.hidden_size)
        # What a checkpoint records for a resume to be compared with (checkpoints.py).
        self.settings = run_settings(loop, self.worker.envs.single_observation_space,
                                     self.worker.envs.single_action_space)
        self.generator = torch.Generator()
        # Before DDP wraps the policy: the exchange binds it to the weights' send or receive buffer.
        self.exchange = Exchange(
            ctx, plan, self.policy,
            segment=(self.hp.num_steps, self.hp.num_envs, obs_dim),
            episode_cap=self.hp.num_envs * (self.hp.num_steps // 8 + 1),
            max_staleness=loop.max_staleness,
            verify_every=loop.verify_weights_every,
        )
        self.model: torch.nn.Module = self.policy
        self.optimizer: torch.optim.Optimizer | None = None
        if self.is_trainer:
            self.model = DistributedDataParallel(
                self.policy, process_group=ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL)
            )
            self.optimizer = make_optimizer(self.policy, self.hp)

        self.update = 0
        self.env_steps = 0
        self.episodes: list[Episode] = []
        self.lag = 0  # the version lag of the data being trained on
        self.metrics: list[dict[str, float]] = []  # one row per update (metrics.csv)
        self.metrics_file: MetricsFile | None = None  # rank 0's, written through per update

    def run(self) -> dict[str, Any]:
        self._maybe_resume()
        if self.rank == 0 and self.is_trainer:
            self.metrics_file = MetricsFile(self.job.run_dir / "metrics.csv", self.metrics)
        first_update, first_steps = self.update, self.env_steps  # this attempt's start
        start = time.perf_counter()
        reached_at: tuple[float, int] | None = None
        view = RunProgress(self.loop.stop_rule()) if self._writes_outputs(self.loop.progress) else None
        scalars = ScalarLog(self.job.run_dir, "ppo") if self._writes_outputs(self.loop.tensorboard) else None
        if self.env_steps < self.loop.total_env_steps:
            self.exchange.sync_weights(self.policy, first=True)
        while self.env_steps < self.loop.total_env_steps:
            version = self.exchange.version(self.update)
            rollouts, new_episodes, shared = self._collect()
            self.episodes.extend(new_episodes)
            self.env_steps += self.collectors * self.hp.num_envs * self.hp.num_steps
            losses = self._train(rollouts) if self.is_trainer else {}
            self.update += 1
            row = self._record(version, new_episodes, losses, shared,
                               self.env_steps - first_steps, time.perf_counter() - start)
            if scalars is not None:
                scalars.write({**row, "mean_return_window": self._recent_return()}, self.env_steps)
            if view is not None:
                view.update(self._snapshot(row, time.perf_counter() - start))
            if self._should_checkpoint():
                self._save_checkpoint()
            if self._recent_return() >= self.loop.target_return:
                reached_at = (time.perf_counter() - start, self.env_steps)
                break
            if self.env_steps < self.loop.total_env_steps:
                self.exchange.sync_weights(self.policy, first=False)
        if self.loop.checkpoint_every and self.update % self.loop.checkpoint_every:
            self._save_checkpoint()  # keep the final state too
        if view is not None:
            view.close()  # after the last checkpoint notice: the bar is the run's last line
        if scalars is not None:
            scalars.close()
        elapsed = time.perf_counter() - start
        if self.metrics_file is not None:
            self.metrics_file.close()
            if self.metrics:
                plot_learning_curve(self.metrics_file.path, self.job.run_dir / "learning_curve.png",
                                    self.loop.target_return)
        self.worker.close()
        steps = self.env_steps - first_steps
        exchange = self.exchange
        metrics = job_metrics(
            self.ctx, self.is_trainer, elapsed=elapsed, transfer_s=exchange.transfer_s,
            wait_s=exchange.wait_total_s, reached_at=reached_at,
            updates=self.update - first_update, steps=steps, recent=self._recent_return(),
        )
        return {
            "role": self.job.plan.role(self.rank),
            "updates": self.update,
            "env_steps": self.env_steps,
            "episodes": len(self.episodes),
            "mean_return_last_window": round(self._recent_return(), 2),
            "reached_target": reached_at is not None,
            "time_to_target_s": round(reached_at[0], 2) if reached_at else None,
            "env_steps_to_target": reached_at[1] if reached_at else None,
            "wall_s": round(elapsed, 2),
            "env_steps_per_s": round(steps / elapsed, 1) if elapsed else 0.0,
            "weights_version": exchange.version(self.update),
            "weight_bytes_sent": exchange.weight_bytes_sent,
            "trajectory_bytes_sent": exchange.trajectory_bytes_sent,
            "max_staleness": self.loop.max_staleness,
            "wait_fraction": round(exchange.wait_total_s / elapsed, 4) if elapsed else 0.0,
            **({"staleness_histogram": {str(k): n for k, n in sorted(exchange.staleness.items())}}
               if self.is_trainer else {}),
            "param_checksum": float(sum(p.detach().double().sum() for p in self.policy.parameters())),
            "metrics": metrics,
        }

    def _collect(self) -> tuple[list[Rollout], list[Episode], dict[str, float]]:
        """This update's segments (trainers) and every rank's finished episodes."""
        own: Rollout | None = None
        mine: list[Episode] = []
        if self.collects:
            own, mine = self.worker.collect(self.policy, self.hp.num_steps)
        rollouts = [own] if (own is not None and not self.split) else []
        lag = 0  # the oldest data's version lag (trainers)
        if self.split:
            rollouts, lag = self.exchange.gather_segments(own, self.update)
        self.lag = lag
        return (rollouts, *self.exchange.share_episodes(mine, lag))

    def _train(self, rollouts: list[Rollout]) -> dict[str, float]:
        assert self.optimizer is not None
        self.exchange.before_optimizer_step()
        set_lr(self.optimizer, self.hp, self.env_steps)
        # Minibatch order is a function of (seed, rank, update): a resumed run shuffles as the
        # uninterrupted one would, with no generator state to carry.
        self.generator.manual_seed((self.job.seed * 10_000 + self.rank) * 1_000_003 + self.update)
        return ppo_update(self.model, self.policy, self.optimizer, rollouts, self.hp, self.generator,
                          decoupled=self.lag > 0)

    def _recent_return(self) -> float:
        """The stop rule's quantity: the mean return of the last ``window`` episodes (-inf
        until that many finished)."""
        recent = self.episodes[-self.loop.window :]
        if len(recent) < self.loop.window:
            return float("-inf")
        return float(np.mean([r for r, _ in recent]))

    def _record(
        self, version: int, new: list[Episode], losses: dict[str, float], shared: dict[str, float],
        attempt_steps: int, elapsed: float,
    ) -> dict[str, float]:
        row = update_row(
            self.ctx, len(self.job.plan.trainers) if self.is_trainer else None,
            self.metrics[-1] if self.metrics else None,
            update=self.update, env_steps=self.env_steps, attempt_steps=attempt_steps,
            elapsed=elapsed, version=version, new=new, recent=self._recent_return(),
            transfer_s=self.exchange.transfer_s, shared=shared, losses=losses,
        )
        self.metrics.append(row)
        if self.metrics_file is not None:
            self.metrics_file.append(row)
        return row

    def _writes_outputs(self, enabled: bool) -> bool:
        return enabled and self.rank == 0

    def _snapshot(self, row: dict[str, float], elapsed: float) -> Snapshot:
        return Snapshot(
            env_steps=self.env_steps,
            mean_return=self._recent_return(),
            episodes=len(self.episodes),
            env_steps_per_s=row["env_steps_per_s"],
            weights_version=int(row["weights_version"]),
            elapsed_s=elapsed,
        )

    def _should_checkpoint(self) -> bool:
        return bool(self.loop.checkpoint_every) and self.update % self.loop.checkpoint_every == 0

    def _save_checkpoint(self) -> None:
        if self.rank != 0 or not self.is_trainer or self.optimizer is None:
            return
        save_checkpoint(self.job.run_dir, self.policy, self.optimizer, self.update,
                        self.env_steps, self.episodes, self.metrics, self.settings)

    def _maybe_resume(self) -> None:
        picked = resume_source(self.ctx, self.job, self.loop.resume)  # verified on load
        if picked is None:
            return
        source, state = picked.path, picked.state
        self.policy.load_state_dict(state["policy"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.update, self.env_steps = state["update"], state["env_steps"]
        self.episodes = [(float(r), int(n)) for r, n in state["episodes"]]
        torch.set_rng_state(state["torch_rng"])
        if source.resolve().is_relative_to(self.job.run_dir.resolve()):
            self.metrics = list(state["metrics"])  # same run: metrics.csv keeps every row
        log.info("resumed from %s at update %d (%d env steps)", source, self.update, self.env_steps)
