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
"""

from __future__ import annotations

import csv
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from app.api import ConfigError, JobInfo, setting
from app.loops.ppo.core import (
    MAX_RETURN,
    ActorCritic,
    PPOHyperParams,
    Rollout,
    RolloutWorker,
    make_optimizer,
    ppo_update,
    set_lr,
)
from app.output.progress import RunProgress, Snapshot, StopRule
from app.output.tensorboard import SUBDIR, ScalarLog, check_tensorboard
from rlcomm import CommContext, LayoutPlan, ParallelMode, collectives
from rlcomm.weight_transfer import WeightReceiver, WeightSender

log = logging.getLogger(__name__)
WT, TDP, GLOBAL = (
    ParallelMode.WEIGHT_TRANSFER,
    ParallelMode.TRAIN_DATA_PARALLEL,
    ParallelMode.GLOBAL,
)
CHECKPOINT_DIR = "checkpoints"
LOSSES = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac")
CHECKPOINT_KEYS = ("policy", "optimizer", "update", "env_steps", "episodes", "metrics", "torch_rng")


class StaleDataError(RuntimeError):
    """A trainer was handed a segment older than ``loop.max_staleness`` allows."""


@dataclass
class PPOLoop:
    total_env_steps: int = setting(400_000, "budget: stop here if the target is not reached")
    target_return: float = setting(475.0, "stop once the mean return of the last `window` episodes reaches it")
    window: int = setting(20, "episodes in the stop rule's mean return")
    checkpoint_every: int = setting(10, "updates between checkpoints; 0 disables them")
    resume: str | None = setting(None, "a checkpoint file, or a run dir holding checkpoints/")
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
        if self.resume is not None:
            load_checkpoint(find_checkpoint(self.resume))
        if self.tensorboard:
            check_tensorboard()

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
        return _PPORun(self, ctx, job).run()


def check_staleness(
    versions: list[tuple[int, int]], current: int, max_staleness: int, update: int
) -> list[int]:
    """Each segment's version lag behind ``current`` (the weights about to be trained) from its
    ``(rank, version)``; a lag beyond ``max_staleness`` (or a version from the future) raises,
    so such data is never trained on."""
    lags = [current - version for _, version in versions]
    for (rank, version), lag in zip(versions, lags):
        if not 0 <= lag <= max_staleness:
            raise StaleDataError(
                f"update {update}: rank {rank}'s segment was collected with weights version "
                f"{version}, {lag} behind version {current} (loop.max_staleness={max_staleness})"
            )
    return lags


def policy_receiver(ctx: CommContext, policy: torch.nn.Module) -> WeightReceiver:
    """The rollout side of WEIGHT_TRANSFER: it accepts exactly ``policy``'s names, shapes and
    dtypes (anything else is an error naming the tensor, on both sides, before data moves)."""
    return WeightReceiver(ctx, WT, expected=policy.state_dict())


def find_checkpoint(path: str | Path) -> Path:
    """The newest checkpoint at ``path`` (a file, a run dir, or its checkpoints/ dir)."""
    target = Path(path)
    if target.is_file():
        return target
    if not target.exists():
        raise ConfigError(f"loop.resume: {str(path)!r} does not exist")
    found = sorted(target.glob(f"{CHECKPOINT_DIR}/ckpt_*.pt")) + sorted(target.glob("ckpt_*.pt"))
    if not found:
        raise ConfigError(f"loop.resume: {str(path)!r} holds no checkpoint (ckpt_*.pt)")
    return max(found, key=lambda p: p.name)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's state; tensors and plain containers only (``weights_only``: no code)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(
            f"loop.resume: {str(path)!r} is not a readable checkpoint ({type(err).__name__})"
        ) from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ConfigError(f"loop.resume: {str(path)!r} is not a PPO checkpoint (missing {missing})")
    return state


class _PPORun:
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
        # A segment travels as [weights version, rollout...]: the version it was collected with.
        self.flat_size = 1 + Rollout.flat_size(self.hp.num_steps, self.hp.num_envs, obs_dim)
        self.episode_cap = self.hp.num_envs * (self.hp.num_steps // 8 + 1)
        self.generator = torch.Generator()

        self.model: torch.nn.Module = self.policy
        self.optimizer: torch.optim.Optimizer | None = None
        self.sender: WeightSender | None = None
        self.receiver: WeightReceiver | None = None
        if self.split and self.is_trainer:
            self.sender = WeightSender(ctx, WT, verify_every=loop.verify_weights_every)
            # Before DDP wraps it: the parameters then live in the send buffer (zero-copy
            # sends), and DDP and the optimizer hold the same Parameter objects as ever.
            self.sender.bind(self.policy)
        elif self.split:
            self.receiver = policy_receiver(ctx, self.policy)
            self.receiver.bind(self.policy)  # loads point the policy at the received bytes
        if self.is_trainer:
            self.model = DistributedDataParallel(self.policy, process_group=ctx.get_group(TDP))
            self.optimizer = make_optimizer(self.policy, self.hp)

        self.update = 0
        self.env_steps = 0
        self.episodes: list[tuple[float, int]] = []
        self.transfer_s = 0.0
        self.trainer_s = 0.0
        # Payload this rank sent to other ranks (weights by a trainer, trajectories by a rollout
        # rank), so a run can be checked against what the network carried.
        self.weight_bytes_sent = 0
        self.trajectory_bytes_sent = 0
        self.weight_bytes = sum(t.nbytes for t in self.policy.state_dict().values())
        self.wait_s = 0.0  # this update's time blocked in the trainer <-> rollout hand-off
        self.wait_total_s = 0.0
        self.staleness: dict[int, int] = {}  # version lag -> segments trained on (trainers)
        self.acting_version = 0  # the weights version the policy holds (rollouts)
        self.lag = 0  # the version lag of the data being trained on
        self.metrics: list[dict[str, float]] = []

    # ---- the loop -------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self._maybe_resume()
        first_update, first_steps = self.update, self.env_steps
        start = time.perf_counter()
        reached_at: tuple[float, int] | None = None
        view = self._progress_view()
        scalars = ScalarLog(self.job.run_dir, "ppo") if self._writes_outputs(self.loop.tensorboard) else None
        if self.env_steps < self.loop.total_env_steps:
            self._sync_weights(first=True)
        while self.env_steps < self.loop.total_env_steps:
            tick = time.perf_counter()
            version = self._version()
            rollouts, new_episodes, shared = self._collect()
            self.episodes.extend(new_episodes)
            self.env_steps += self.collectors * self.hp.num_envs * self.hp.num_steps
            losses = self._train(rollouts) if self.is_trainer else {}
            if self.is_trainer:
                self.trainer_s += time.perf_counter() - tick
            self.update += 1
            row = self._record(version, new_episodes, losses, shared, time.perf_counter() - start)
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
                self._sync_weights(first=False)
        if self.loop.checkpoint_every and self.update % self.loop.checkpoint_every:
            self._save_checkpoint()  # keep the final state too
        if view is not None:
            view.close()  # after the last checkpoint notice: the bar is the run's last line
        if scalars is not None:
            scalars.close()
        elapsed = time.perf_counter() - start
        if self.rank == 0:
            self._write_outputs()
        self.worker.close()
        metrics = self._job_metrics(
            elapsed, reached_at, self.update - first_update, self.env_steps - first_steps
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
            "env_steps_per_s": round(self.env_steps / elapsed, 1) if elapsed else 0.0,
            "weights_version": self._version(),
            "transfer_fraction": round(self.transfer_s / self.trainer_s, 4)
            if self.trainer_s
            else 0.0,
            "weight_bytes_sent": self.weight_bytes_sent,
            "trajectory_bytes_sent": self.trajectory_bytes_sent,
            "max_staleness": self.loop.max_staleness,
            "wait_fraction": round(self.wait_total_s / elapsed, 4) if elapsed else 0.0,
            **({"staleness_histogram": {str(k): n for k, n in sorted(self.staleness.items())}}
               if self.is_trainer else {}),
            "param_checksum": float(sum(p.detach().double().sum() for p in self.policy.parameters())),
            "metrics": metrics,
        }

    def _sync_weights(self, first: bool) -> None:
        """Trainers send the weights the next segment will be trained with; rollouts take the
        newest weights that have arrived, waiting only as long as ``max_staleness`` requires.

        The first transfer (it carries the layout) is complete on both sides when this returns.
        Later sends are launched without waiting (the trainer waits before its next optimizer
        step, which rewrites the bound send buffer); on the group they are issued, like the
        rollouts' posted receives, between one segment's gather and the next, so every member
        issues the same operations in the same order.
        """
        tick = time.perf_counter()
        if self.sender is not None:
            self.sender.send(self.policy, wait=first)  # bound: no state dict, no copy
            self.transfer_s += time.perf_counter() - tick
            receivers = len(self.ctx.get_ranks_in_group(WT)) - 1
            self.weight_bytes_sent += receivers * self.weight_bytes
        elif self.receiver is not None:
            if first or self.loop.max_staleness == 0:
                # Lockstep: the policy is idle until these weights arrive, so they land in the
                # bytes it acts with (no second buffer, nothing to swap).
                self.acting_version = self.receiver.receive_into(self.policy)
            else:
                self.receiver.post()
                # The trainer will train the next segment with the version just posted.
                newest = self.receiver.version + self.receiver.posted
                while self.receiver.version < newest - self.loop.max_staleness:
                    self.receiver.receive()  # completes the oldest posted receive
                # A segment boundary: swap in the newest version that has arrived.
                self.acting_version = self.receiver.load(self.policy)
            self.wait_s += time.perf_counter() - tick

    def _version(self) -> int:
        """The weights version this rank acts (rollouts) or trains (trainers) with."""
        if self.sender is not None:
            return self.sender.version
        if self.receiver is not None:
            return self.acting_version
        return self.update

    def _collect(self) -> tuple[list[Rollout], list[tuple[float, int]], dict[str, float]]:
        own: Rollout | None = None
        mine: list[tuple[float, int]] = []
        if self.collects:
            own, mine = self.worker.collect(self.policy, self.hp.num_steps)
        rollouts = [own] if (own is not None and not self.split) else []
        lag = 0  # the oldest data's version lag (trainers)
        if self.split:
            # Trajectories travel as one float32 tensor per rollout rank: data, not code.
            flat = torch.zeros(self.flat_size)
            if own is not None:
                flat = torch.cat([torch.tensor([float(self._version())]), own.to_flat_tensor()])
            trainer = self.ctx.get_declared_ranks(WT)[0]
            tick = time.perf_counter()
            gathered = collectives.gather(self.ctx, WT, flat, dst=trainer)
            if self.rank != trainer:
                self.trajectory_bytes_sent += flat.nbytes
            self.wait_s += time.perf_counter() - tick
            if gathered is not None:
                members = self.ctx.get_ranks_in_group(WT)
                segments = [(r, t) for r, t in zip(members, gathered) if r != trainer]
                versions = [(r, int(t[0].item())) for r, t in segments]
                lags = check_staleness(versions, self._version(), self.loop.max_staleness,
                                       self.update + 1)
                for one in lags:
                    self.staleness[one] = self.staleness.get(one, 0) + 1
                lag = max(lags, default=0)
                rollouts = [
                    Rollout.from_flat_tensor(t[1:], self.hp.num_steps, self.hp.num_envs, self.worker.obs_dim)
                    for _, t in segments
                ]
        self.lag = lag
        return (rollouts, *self._share_episodes(mine, lag))

    def _share_episodes(
        self, mine: list[tuple[float, int]], lag: int
    ) -> tuple[list[tuple[float, int]], dict[str, float]]:
        """Everyone learns every finished episode, so all ranks stop at the same update; the
        same message carries each rank's waiting time and its data's version lag."""
        packed = torch.full((self.episode_cap + 2, 2), float("nan"))
        kept = mine[-self.episode_cap :]
        packed[0] = torch.tensor([len(kept), float(self.is_trainer)])
        packed[1] = torch.tensor([self.wait_s, lag])
        if kept:
            packed[2 : len(kept) + 2] = torch.tensor(kept, dtype=torch.float32)
        everyone = collectives.all_gather(self.ctx, GLOBAL, packed.unsqueeze(0))
        self.wait_total_s += self.wait_s
        self.wait_s = 0.0
        episodes = []
        waits: dict[bool, list[float]] = {True: [], False: []}
        for block in everyone:
            count, trainer = int(block[0, 0].item()), bool(block[0, 1].item())
            waits[trainer].append(float(block[1, 0]))
            episodes += [(float(r), int(n)) for r, n in block[2 : count + 2].tolist()]
        shared = {
            "staleness": float(everyone[:, 1, 1].max()),
            "trainer_wait_s": float(np.mean(waits[True])),
            "rollout_wait_s": float(np.mean(waits[False])) if waits[False] else 0.0,
        }
        return episodes, shared

    def _train(self, rollouts: list[Rollout]) -> dict[str, float]:
        assert self.optimizer is not None
        if self.sender is not None:
            tick = time.perf_counter()
            self.sender.wait()  # the optimizer is about to rewrite the bytes being sent
            self.transfer_s += time.perf_counter() - tick
        set_lr(self.optimizer, self.hp, self.env_steps)
        # Minibatch order is a function of (seed, rank, update): a resumed run shuffles as the
        # uninterrupted one would, with no generator state to carry.
        self.generator.manual_seed((self.job.seed * 10_000 + self.rank) * 1_000_003 + self.update)
        return ppo_update(self.model, self.policy, self.optimizer, rollouts, self.hp, self.generator,
                          decoupled=self.lag > 0)

    def _recent_return(self) -> float:
        recent = self.episodes[-self.loop.window :]
        if len(recent) < self.loop.window:
            return float("-inf")
        return float(np.mean([r for r, _ in recent]))

    # ---- metrics ---------------------------------------------------------------------------
    def _record(
        self,
        version: int,
        new: list[tuple[float, int]],
        losses: dict[str, float],
        shared: dict[str, float],
        elapsed: float,
    ) -> dict[str, float]:
        """This update's metrics row. Only trainers reduce (over TRAIN_DATA_PARALLEL): a
        collective with the rollouts here would make them wait for every update. Rollouts'
        rows (never written) carry NaN losses."""
        transfer_total = self.metrics[-1]["transfer_s_total"] if self.metrics else 0.0
        if self.is_trainer:
            reduced = collectives.all_reduce_dict(
                self.ctx, TDP, {"transfer_s": self.transfer_s, **losses}
            )
            trainers = len(self.job.plan.trainers)
            losses = {k: reduced[k] / trainers for k in LOSSES}
            transfer_now = reduced["transfer_s"]
        else:
            losses = dict.fromkeys(LOSSES, float("nan"))
            transfer_now = transfer_total
        recent = self._recent_return()
        row = {
            "update": float(self.update),
            "env_steps": float(self.env_steps),
            "wall_s": elapsed,
            "mean_return": float(np.mean([r for r, _ in new])) if new else float("nan"),
            "return_window": recent if recent > float("-inf") else float("nan"),
            "mean_length": float(np.mean([n for _, n in new])) if new else float("nan"),
            "episodes": float(len(new)),
            "env_steps_per_s": self.env_steps / elapsed if elapsed else 0.0,
            "weights_version": float(version),
            "transfer_s_total": transfer_now,
            "transfer_s": transfer_now - transfer_total,
            **shared,
            **losses,
        }
        self.metrics.append(row)
        return row

    def _job_metrics(
        self, elapsed: float, reached_at: tuple[float, int] | None, updates: int, steps: int
    ) -> dict[str, float | None]:
        """The figures that compare jobs (app/sweep/metrics.py), the same on every rank: per-role
        times are summed over GLOBAL in one collective, so the fractions are the whole job's."""
        rollout = not self.is_trainer
        totals = collectives.all_reduce_dict(self.ctx, GLOBAL, {
            "trainers": float(self.is_trainer),
            "trainer_s": elapsed if self.is_trainer else 0.0,
            "trainer_wait_s": self.wait_total_s if self.is_trainer else 0.0,
            "transfer_s": self.transfer_s,
            "rollouts": float(rollout),
            "rollout_s": elapsed if rollout else 0.0,
            "rollout_wait_s": self.wait_total_s if rollout else 0.0,
        })

        def share(part: float, whole: float) -> float | None:
            return round(part / whole, 4) if whole > 0 else None

        recent = self._recent_return()  # -inf before `window` episodes finished
        return {
            "env_steps_per_s": round(steps / elapsed, 1) if elapsed else None,
            "time_to_target_s": round(reached_at[0], 2) if reached_at else None,
            "env_steps_to_target": reached_at[1] if reached_at else None,
            "reached_target": 1 if reached_at else 0,
            "updates_per_s": round(updates / elapsed, 2) if elapsed else None,
            "transfer_s": round(totals["transfer_s"] / totals["trainers"], 3),
            "transfer_share": share(totals["transfer_s"], totals["trainer_s"]),
            "trainer_wait_fraction": share(totals["trainer_wait_s"], totals["trainer_s"]),
            "rollout_wait_fraction": share(totals["rollout_wait_s"], totals["rollout_s"]),
            "final_mean_return": round(recent, 2) if recent > float("-inf") else None,
        }

    def _writes_outputs(self, enabled: bool) -> bool:
        return enabled and self.rank == 0

    def _progress_view(self) -> RunProgress | None:
        return RunProgress(self.loop.stop_rule()) if self._writes_outputs(self.loop.progress) else None

    def _snapshot(self, row: dict[str, float], elapsed: float) -> Snapshot:
        return Snapshot(
            env_steps=self.env_steps,
            mean_return=self._recent_return(),
            episodes=len(self.episodes),
            env_steps_per_s=row["env_steps_per_s"],
            weights_version=int(row["weights_version"]),
            elapsed_s=elapsed,
        )

    def _write_outputs(self) -> None:
        if not self.metrics or not self.is_trainer:
            return
        path = self.job.run_dir / "metrics.csv"
        names = list(self.metrics[0])
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=names)
            writer.writeheader()
            writer.writerows(self.metrics)
        plot_learning_curve(path, self.job.run_dir / "learning_curve.png", self.loop.target_return)

    # ---- checkpoints -----------------------------------------------------------------------
    def _should_checkpoint(self) -> bool:
        return bool(self.loop.checkpoint_every) and self.update % self.loop.checkpoint_every == 0

    def _save_checkpoint(self) -> None:
        if self.rank != 0 or not self.is_trainer or self.optimizer is None:
            return
        folder = self.job.run_dir / CHECKPOINT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            # Clones: the parameters are views of the (larger) send buffer.
            "policy": {k: v.clone() for k, v in self.policy.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "update": self.update,
            "env_steps": self.env_steps,
            "episodes": self.episodes,
            "metrics": self.metrics,
            # Minibatch order needs no state (seeded per update); environments restart from
            # their seeds on resume, so only torch's global RNG is carried.
            "torch_rng": torch.get_rng_state(),
        }
        for stale in folder.glob("*.tmp"):  # left by a rank killed inside torch.save
            stale.unlink(missing_ok=True)
        final = folder / f"ckpt_{self.update:06d}.pt"
        partial = final.with_suffix(".tmp")
        torch.save(state, partial)
        os.replace(partial, final)  # never a half-written checkpoint
        log.info("checkpoint %s (update %d, %d env steps)", final.name, self.update, self.env_steps)

    def _maybe_resume(self) -> None:
        source: Path | None = None
        # Every rank resumes alike: a host restarted by hand joins with a new torchrun, whose
        # restart count (0) is not the others'.
        counts = torch.tensor([self.job.env.restart_count])
        restarted = int(collectives.all_reduce(self.ctx, GLOBAL, counts, torch.distributed.ReduceOp.MAX))
        if restarted > 0:
            # Restarted by the agent after a failure: this run's newest checkpoint wins.
            try:
                source = find_checkpoint(self.job.run_dir)
            except ConfigError:
                source = None
        if source is None and self.loop.resume:
            source = find_checkpoint(self.loop.resume)
        if source is None:
            return
        state = load_checkpoint(source)
        self.policy.load_state_dict(state["policy"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.update, self.env_steps = state["update"], state["env_steps"]
        self.episodes = [(float(r), int(n)) for r, n in state["episodes"]]
        torch.set_rng_state(state["torch_rng"])
        if source.resolve().is_relative_to(self.job.run_dir.resolve()):
            self.metrics = list(state["metrics"])  # same run: metrics.csv keeps every row
        log.info("resumed from %s at update %d (%d env steps)", source, self.update, self.env_steps)


def plot_learning_curve(metrics_csv: Path, png: Path, target: float) -> None:
    """The stop rule's quantity (mean return of the last ``window`` episodes) against env steps
    and against wall time, with each update's mean return faint behind it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with metrics_csv.open() as handle:
        rows = [r for r in csv.DictReader(handle) if r["mean_return"] not in ("", "nan")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, x_key, label in zip(axes, ("env_steps", "wall_s"), ("env steps", "wall time (s)")):
        x = [float(r[x_key]) for r in rows]
        ax.plot(x, [float(r["mean_return"]) for r in rows], alpha=0.3, label="update mean")
        ax.plot(x, [float(r["return_window"]) for r in rows], label="mean of last window")
        ax.axhline(target, linestyle="--", color="grey")
        ax.set_xlabel(label)
    axes[0].set_ylabel("episodic return")
    axes[0].legend(loc="lower right")
    fig.suptitle("PPO CartPole-v1")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
