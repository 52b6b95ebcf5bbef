"""One rank's run: collect, hand off, train, record, until the stop rule fires.

Every rank runs the same loop; its role decides which steps do work (rollouts collect, trainers
train, colocated ranks do both) and every rank takes part in the same collectives in the same
order (app/runtime/exchange.py). The stop decision is taken from the episodes every rank shares,
so all ranks leave the loop at the same update. The algorithm only acts (in the worker) and
updates (here, on trainers); everything else is this module's.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from app.api import JobInfo
from app.output import timeline
from app.output.background import in_background
from app.output.progress import RunProgress, Snapshot
from app.output.tensorboard import ScalarLog
from app.runtime.algorithm import Segment, UpdateInfo
from app.runtime.checkpoints import resume_source, run_settings, save_checkpoint
from app.runtime.envs import probe_spaces
from app.runtime.exchange import Exchange
from app.runtime.records import MetricsFile, job_metrics, plot_learning_curve, update_row
from app.runtime.worker import Agent, Episode, RolloutWorker, as_segment, segment_layout
from rlcomm import CommContext, ParallelMode, collectives

if TYPE_CHECKING:
    from app.runtime.loop import RLLoop

log = logging.getLogger(__name__)


class RuntimeRun:
    """One rank's state for one run of the loop."""

    def __init__(self, loop: RLLoop, ctx: CommContext, job: JobInfo) -> None:
        self.loop, self.ctx, self.job, self.hp = loop, ctx, job, loop.hp
        plan = job.plan
        self.rank = ctx.get_global_rank()
        self.is_trainer = self.rank in plan.trainers
        self.collects = plan.colocated or self.rank in plan.rollouts
        self.split = not plan.colocated
        self.collectors = len(plan.trainers) if plan.colocated else len(plan.rollouts)

        # Small models gain nothing from intra-op threads, and on shared cores they spin
        # against each other (layout=single under load: 459 s to the target with 2, 25 s with 1).
        torch.set_num_threads(1)
        torch.manual_seed(job.seed)  # same initial weights on every rank
        self.spaces = probe_spaces(loop.env)  # one env, built and closed
        self.algorithm = loop.build_algorithm(self.spaces)
        # What the rollouts act with, and what the weights carry: the algorithm's module and
        # the normalisers' statistics.
        self.agent = Agent(self.algorithm.build(), self.spaces, loop.env)
        self.worker = (RolloutWorker(self.algorithm, self.spaces, loop.env, self.agent,
                                     seed=job.seed * 10_000 + self.rank)
                       if self.collects else None)
        self.layout = segment_layout(self.algorithm, self.spaces, self.agent,
                                     self.hp.num_steps, self.hp.num_envs)
        # What a checkpoint records for a resume to be compared with (checkpoints.py).
        self.settings = run_settings(loop, self.spaces)
        self.generator = torch.Generator()
        # Before DDP wraps the module: the exchange binds the agent to the weights' send or
        # receive buffer.
        self.exchange = Exchange(
            ctx, plan, self.agent, self.layout,
            episode_cap=self.hp.num_envs * (self.hp.num_steps // 8 + 1),
            max_staleness=loop.max_staleness,
            verify_every=loop.verify_weights_every,
        )
        self.model: torch.nn.Module = self.agent.net
        self.optimizer: torch.optim.Optimizer | None = None
        if self.is_trainer:
            self.model = DistributedDataParallel(
                self.agent.net, process_group=ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL)
            )
            self.optimizer = self.algorithm.optimizer(self.agent.net)

        self.update = 0
        self.env_steps = 0
        self.episodes: list[Episode] = []
        self.lag = 0  # the version lag of the data being trained on
        self.metrics: list[dict[str, float]] = []  # one row per update (metrics.csv)
        self.metrics_file: MetricsFile | None = None  # rank 0's, written through per update
        # Measured seconds of this attempt: collecting (the worker splits out env stepping and
        # the policy's forward), the update, and communication (time_split_s in the result).
        self.split_s = {"collect": 0.0, "update": 0.0, "comm": 0.0}

    def run(self) -> dict[str, Any]:
        self._maybe_resume()
        if self.rank == 0 and self.is_trainer:
            self.metrics_file = MetricsFile(self.job.run_dir / "metrics.csv", self.metrics)
        first_update, first_steps = self.update, self.env_steps  # this attempt's start
        start, cpu_start = time.perf_counter(), time.process_time()
        reached_at: tuple[float, int] | None = None
        rule = self.loop.stop_rule()
        target = self.loop.target()  # with loop.stop_at_target=false: noted, not the end
        view = RunProgress(rule, self._name()) if self._writes_outputs(self.loop.progress) else None
        scalars = (ScalarLog(self.job.run_dir, self._name())
                   if self._writes_outputs(self.loop.tensorboard) else None)
        if self.env_steps < self.loop.total_env_steps:
            self._sync_weights(first=True)
        while self.env_steps < self.loop.total_env_steps:
            version = self.exchange.version(self.update)
            segments, new_episodes, shared = self._collect(version)
            self.episodes.extend(new_episodes)
            self.env_steps += self.collectors * self.hp.num_envs * self.hp.num_steps
            losses = self._train(segments) if self.is_trainer else {}
            self.update += 1
            row = self._record(version, new_episodes, losses, shared,
                               self.env_steps - first_steps, time.perf_counter() - start)
            timeline.mark("first_update")  # the first time counts (app/output/timeline.py)
            if scalars is not None:
                scalars.write({**row, "mean_return_window": self._recent_return()}, self.env_steps)
            if view is not None:
                view.update(self._snapshot(row, time.perf_counter() - start))
            if self._should_checkpoint():
                self._save_checkpoint()
            if reached_at is None and target is not None and self._recent_return() >= target:
                reached_at = (time.perf_counter() - start, self.env_steps)
                if self.loop.stop_at_target:
                    break
            if self.env_steps < self.loop.total_env_steps:
                self._sync_weights(first=False)
        timeline.mark("stop")
        if self.loop.checkpoint_every and self.update % self.loop.checkpoint_every:
            self._save_checkpoint()  # keep the final state too
        if view is not None:
            view.close()  # after the last checkpoint notice: the bar is the run's last line
        if scalars is not None:  # written before success is reported (app/launch/rank.py)
            in_background(scalars.close, name="TensorBoard scalars")
        elapsed = time.perf_counter() - start
        cpu_s = time.process_time() - cpu_start
        if self.metrics_file is not None:
            self.metrics_file.close()
            if self.metrics:
                in_background(plot_learning_curve, self.metrics_file.path,
                              self.job.run_dir / "learning_curve.png", target,
                              f"{self._name()} {self.loop.env.id}", name="learning curve")
        if self.worker is not None:
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
            "time_split_s": self._time_split(elapsed),
            "cpu_s": round(cpu_s, 3),  # this process's CPU time over the loop (all threads)
            **({"staleness_histogram": {str(k): n for k, n in sorted(exchange.staleness.items())}}
               if self.is_trainer else {}),
            "param_checksum": float(sum(p.detach().double().sum()
                                        for p in self.agent.net.parameters())),
            "metrics": {**metrics, **self._declared_losses()},
        }

    def _declared_losses(self) -> dict[str, float | None]:
        """The last update's figures of the algorithm's that its loop declares as metrics
        (``RLLoop.metrics``), for a sweep to rank by (None on rollout ranks, which train not)."""
        declared = type(self.loop).metrics.directions
        last = self.metrics[-1] if self.metrics else {}
        figures = {}
        for name in self.algorithm.losses:
            if name in declared:
                value = last.get(name, float("nan"))
                figures[name] = round(float(value), 6) if np.isfinite(value) else None
        return figures

    def _time_split(self, elapsed: float) -> dict[str, float]:
        """Where this rank's loop time (``loop``, this attempt's) went, measured: stepping the
        envs (``env``), the policy's forward and sampling (``act``), the rest of collecting
        (``collect_other``: normalising, packing), the update (``update``: DDP's gradient
        all-reduce included), communication (``comm``: segments, weights, episodes and the
        normalisers' statistics, time blocked on other ranks included) and the rest
        (``other``: records, checkpoints, the progress line). Zero for what a role does not do."""
        env = self.worker.env_s if self.worker is not None else 0.0
        act = self.worker.act_s if self.worker is not None else 0.0
        parts = {"env": env, "act": act, "collect_other": self.split_s["collect"] - env - act,
                 "update": self.split_s["update"], "comm": self.split_s["comm"]}
        parts["other"] = elapsed - sum(parts.values())
        return {name: round(value, 3) for name, value in {**parts, "loop": elapsed}.items()}

    def _sync_weights(self, first: bool) -> None:
        tick = time.perf_counter()
        self.exchange.sync_weights(self.agent, first=first)
        self.split_s["comm"] += time.perf_counter() - tick

    def _name(self) -> str:
        return type(self.algorithm).__name__.lower()

    def _collect(self, version: int) -> tuple[list[Segment], list[Episode], dict[str, float]]:
        """This update's segments (trainers) and every rank's finished episodes."""
        own: torch.Tensor | None = None
        mine: list[Episode] = []
        if self.worker is not None:
            tick = time.perf_counter()
            own, mine = self.worker.collect(self.agent, version)
            self.split_s["collect"] += time.perf_counter() - tick
        segments = [as_segment(self.layout, own)] if (own is not None and not self.split) else []
        tick = time.perf_counter()
        if self.split:
            segments = self.exchange.gather_segments(own, self.update)
        self.lag = max((s.lag for s in segments), default=0)
        shared = self.exchange.share_episodes(mine, self.lag)
        self.split_s["comm"] += time.perf_counter() - tick
        return (segments, *shared)

    def _train(self, segments: list[Segment]) -> dict[str, float]:
        assert self.optimizer is not None
        tick = time.perf_counter()
        self.exchange.before_optimizer_step()  # the bound agent is about to change
        self._fold_moments(segments)
        self.split_s["comm"] += time.perf_counter() - tick
        # Minibatch order is a function of (seed, rank, update): a resumed run shuffles as the
        # uninterrupted one would, with no generator state to carry.
        self.generator.manual_seed((self.job.seed * 10_000 + self.rank) * 1_000_003 + self.update)
        info = UpdateInfo(self.optimizer, self.generator, self.env_steps, self.update, self.lag)
        tick = time.perf_counter()
        losses = self.algorithm.update(self.model, self.agent.net, segments, info)
        self.split_s["update"] += time.perf_counter() - tick
        return losses

    def _fold_moments(self, segments: list[Segment]) -> None:
        """The trainers fold what their collectors observed into the normalisers' statistics,
        all trainers alike (summed over TRAIN_DATA_PARALLEL), so the next weights carry them."""
        norms = {"obs_moments": self.agent.obs_norm, "return_moments": self.agent.reward_norm}
        for key, norm in norms.items():
            if norm is None:
                continue
            parts = [s.moments[key] for s in segments]
            combined = parts[0].clone()
            for part in parts[1:]:
                combined = norm.combine(combined, part)
            everyone = collectives.all_gather(self.ctx, ParallelMode.TRAIN_DATA_PARALLEL,
                                              combined.unsqueeze(0))
            for moments in everyone:  # the same order on every trainer: identical statistics
                norm.merge(moments)

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
            self.metrics[-1] if self.metrics else None, self.algorithm.losses,
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
        save_checkpoint(self.job.run_dir, self.agent.net, self.optimizer, self.update,
                        self.env_steps, self.episodes, self.metrics, self.settings,
                        self.agent.normalizers())

    def _maybe_resume(self) -> None:
        picked = resume_source(self.ctx, self.job, self.loop.resume)  # verified on load
        if picked is None:
            return
        source, state = picked.path, picked.state
        self.agent.net.load_state_dict(state["policy"])
        for name, value in state.get("normalizers", {}).items():
            self.agent.state_dict()[name].copy_(value)  # in place: the tensors are bound
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.update, self.env_steps = state["update"], state["env_steps"]
        self.episodes = [(float(r), int(n)) for r, n in state["episodes"]]
        torch.set_rng_state(state["torch_rng"])
        if source.resolve().is_relative_to(self.job.run_dir.resolve()):
            self.metrics = list(state["metrics"])  # same run: metrics.csv keeps every row
        log.info("resumed from %s at update %d (%d env steps)", source, self.update, self.env_steps)
