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

from app.api import JobInfo
from app.output import pictures, timeline
from app.output.background import in_background
from app.output.learning_curve import plot_learning_curve
from app.output.progress import RunProgress, Snapshot
from app.output.tensorboard import ScalarLog
from app.runtime.algorithm import Segment, UpdateInfo
from app.runtime.checkpoints import (
    load_sharded_checkpoint,
    resume_source,
    run_settings,
    save_checkpoint,
    save_sharded_checkpoint,
)
from app.runtime.envs import probe_spaces
from app.runtime.exchange import Exchange
from app.runtime.membership import LeaderExchange, MemberExchange
from app.runtime.records import MetricsFile, job_metrics, update_row
from app.runtime.segments import with_episodes
from app.runtime.sharding import TrainedModule, TrainerGrid, share_segments
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
        # Rollout ranks may leave and join (app/runtime/membership.py).
        self.elastic = self.split and plan.elastic_rollouts
        self.epoch_base = 0  # a resumed run's epochs count on from its checkpoint's

        # Small models gain nothing from intra-op threads, and on shared cores they spin
        # against each other (layout=single under load: 459 s to the target with 2, 25 s with 1).
        torch.set_num_threads(1)
        torch.manual_seed(job.seed)  # same initial weights on every rank
        self.spaces = probe_spaces(loop.env)  # one env, built and closed
        self.algorithm = loop.build_algorithm(self.spaces)
        # What the rollouts act with, and what the weights carry: the policy (the algorithm's
        # module, or loop.model's) and the normalisers' statistics.
        self.agent = Agent(loop.build_policy(self.algorithm, self.spaces), self.spaces,
                           loop.env, context=loop.model.history)
        self.worker = (RolloutWorker(self.algorithm, self.spaces, loop.env, self.agent,
                                     seed=job.seed * 10_000 + self.rank)
                       if self.collects else None)
        self.layout = segment_layout(self.algorithm, self.spaces, self.agent,
                                     self.hp.num_steps, self.hp.num_envs)
        self.grid = TrainerGrid.of(plan)
        # What a checkpoint records for a resume to be compared with (checkpoints.py).
        self.settings = run_settings(loop, self.spaces)
        self.generator = torch.Generator()
        # Before DDP wraps the module: the exchange binds the agent to the weights' send or
        # receive buffer.
        self.exchange: Any
        episode_cap = self.hp.num_envs * (self.hp.num_steps // 8 + 1)
        if self.elastic:
            self.layout = with_episodes(self.layout, episode_cap)
            if self.worker is not None:
                self.worker.use_layout(self.layout)
            timeout_s = ctx.timeout.total_seconds()
            if self.is_trainer:
                self.exchange = LeaderExchange(
                    ctx, self.agent, self.layout, loop.max_staleness, loop.verify_weights_every,
                    loop.min_rollouts, timeout_s, dict(job.hosts))
            else:
                self.exchange = MemberExchange(
                    ctx, self.agent, self.layout,
                    plan.groups_of(self.rank)[ParallelMode.WEIGHT_TRANSFER.value][0],
                    loop.max_staleness, timeout_s, joining=job.joining)
        else:
            self.exchange = Exchange(
                ctx, plan, self.agent, self.layout, episode_cap=episode_cap,
                max_staleness=loop.max_staleness, verify_every=loop.verify_weights_every,
            )
        self.trained: TrainedModule | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        # The ranks of one TENSOR_PARALLEL group train one replica on the same batch, in the
        # same minibatch order: they seed it from the group's first rank.
        self.replica_rank = self.rank
        if self.is_trainer:
            self.trained = TrainedModule(ctx, plan, self.agent.net, loop.data_parallel)
            self.optimizer = self.algorithm.optimizer(self.trained.trained)
            if self.grid.tensor > 1:
                self.replica_rank = min(plan.groups_of(self.rank)[ParallelMode.TENSOR_PARALLEL.value])

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
        if self.elastic and not self.is_trainer:
            return self._run_member()
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
        if view is not None and isinstance(self.exchange, LeaderExchange):
            self.exchange.on_wait = view.waiting
        if self.env_steps < self.loop.total_env_steps:
            self._sync_weights(first=True)
        while self.env_steps < self.loop.total_env_steps:
            version = self.exchange.version(self.update)
            segments, new_episodes, shared = self._collect(version)
            self.episodes.extend(new_episodes)
            collected = int(shared.pop("segments", self.collectors))
            self.env_steps += collected * self.hp.num_envs * self.hp.num_steps
            losses = self._train(segments) if self.is_trainer else {}
            if isinstance(self.exchange, LeaderExchange):
                self.exchange.update_done()
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
        if isinstance(self.exchange, LeaderExchange):
            self.exchange.stop(self.update, self.env_steps)
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
                in_background(pictures.draw, plot_learning_curve, self.metrics_file.path,
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
            over=(ParallelMode.TRAIN_DATA_PARALLEL if self.elastic else ParallelMode.GLOBAL),
        )
        if self.elastic and elapsed:  # the rollout ranks' waits came with their segments
            waited = sum(row["rollout_wait_s"] for row in self.metrics[first_update:])
            metrics["rollout_wait_fraction"] = round(waited / elapsed, 4)
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
            **(self._membership_result() if isinstance(exchange, LeaderExchange) else {}),
        }

    def _membership_result(self) -> dict[str, Any]:
        """Who left and joined this trainer's group, and what was lost with them."""
        exchange = self.exchange
        return {
            "epoch": self.epoch_base + exchange.epoch,
            "members": list(exchange.live),
            "changes": [c.record() for c in exchange.changes],
            "segments_discarded": exchange.discarded,
        }

    def _run_member(self) -> dict[str, Any]:
        """A rollout rank of an elastic run: collect, send, take the next weights, until its
        trainer says the run stopped (app/runtime/membership.py)."""
        assert self.worker is not None and isinstance(self.exchange, MemberExchange)
        exchange = self.exchange
        if not self.job.joining:  # where the run resumed, if it did (the weights come next)
            picked = resume_source(self.ctx, self.job, self.loop.resume, over=None)
            if picked is not None:
                log.info("resumed from %s at update %d (%d env steps)", picked.path,
                         picked.state["update"], picked.state["env_steps"])
        start, cpu_start = time.perf_counter(), time.process_time()
        segments = 0
        going = exchange.sync_weights(first=True)
        while going:
            tick = time.perf_counter()
            own, mine = self.worker.collect(self.agent, exchange.version(0))
            self.split_s["collect"] += time.perf_counter() - tick
            tick = time.perf_counter()
            lost = exchange.send_segment(own, mine)
            if lost is None:
                segments += 1
                going = exchange.sync_weights(first=False)
            else:  # lost with its group: on a new epoch's weights already, or stopped
                going = lost
            self.split_s["comm"] += time.perf_counter() - tick
            timeline.mark("first_update")
        timeline.mark("stop")
        self.worker.close()
        elapsed = time.perf_counter() - start
        steps = segments * self.hp.num_envs * self.hp.num_steps
        return {
            "role": self.job.plan.role(self.rank),
            # The job's counts, as its trainer stopped at, like every rank reports them; then
            # this rank's own: the segments it sent and the env steps it collected.
            "updates": exchange.final.get("updates"),
            "env_steps": exchange.final.get("env_steps"),
            "segments_sent": segments,
            "env_steps_collected": steps,
            "weights_version": exchange.acting_version,
            "epoch": exchange.epoch,
            "joined": self.job.joining,
            "trajectory_bytes_sent": exchange.trajectory_bytes_sent,
            "wall_s": round(elapsed, 2),
            "env_steps_per_s": round(steps / elapsed, 1) if elapsed else 0.0,
            "wait_fraction": round(exchange.wait_total_s / elapsed, 4) if elapsed else 0.0,
            "time_split_s": self._time_split(elapsed),
            "cpu_s": round(time.process_time() - cpu_start, 3),
            "param_checksum": float(sum(p.detach().double().sum()
                                        for p in self.agent.net.parameters())),
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
        if isinstance(self.exchange, LeaderExchange):
            tick = time.perf_counter()
            segments, episodes, member_wait = self.exchange.gather_segments(self.update)
            self.lag = max((s.lag for s in segments), default=0)
            shared = self._share_among_trainers(segments, episodes, member_wait)
            self.split_s["comm"] += time.perf_counter() - tick
            return (segments, *shared)
        segments = [as_segment(self.layout, own)] if (own is not None and not self.split) else []
        tick = time.perf_counter()
        if self.split:
            segments = self.exchange.gather_segments(own, self.update)
        self.lag = max((s.lag for s in segments), default=0)
        shared = self.exchange.share_episodes(mine, self.lag)
        self.split_s["comm"] += time.perf_counter() - tick
        return (segments, *shared)

    def _share_among_trainers(
        self, segments: list[Segment], episodes: list[Episode], member_wait: float
    ) -> tuple[list[Episode], dict[str, float]]:
        """Elastic runs: the trainers learn every finished episode (their members' segments
        carried them) and each other's membership, so all stop at the same update; nothing here
        involves a rollout rank."""
        exchange = self.exchange
        cap = self.exchange.layout.fields["episodes"].shape[0] * max(1, len(exchange.members))
        kept = episodes[-cap:]
        row = torch.full((cap + 2, 3), float("nan"), dtype=torch.float64)
        row[0] = torch.tensor([len(kept), len(segments), len(exchange.live)])
        row[1] = torch.tensor([exchange.wait_s, member_wait, self.lag])
        exchange.wait_total_s += exchange.wait_s
        exchange.wait_s = 0.0
        if kept:
            row[2 : len(kept) + 2, :2] = torch.tensor(kept, dtype=torch.float64)
        size = torch.tensor([float(cap)])
        largest = int(collectives.all_reduce(self.ctx, ParallelMode.TRAIN_DATA_PARALLEL, size,
                                             torch.distributed.ReduceOp.MAX).item())
        if largest > cap:  # members joined elsewhere: everyone's block has the same shape
            row = torch.cat([row, torch.full((largest - cap, 3), float("nan"),
                                             dtype=torch.float64)])
        epoch = torch.tensor([float(exchange.epoch)])
        everyone = collectives.all_gather(self.ctx, ParallelMode.TRAIN_DATA_PARALLEL,
                                          torch.cat([row, epoch.expand(1, 3).double()]).unsqueeze(0))
        shared_episodes: list[Episode] = []
        for block in everyone:
            count = int(block[0, 0].item())
            shared_episodes += [(float(r), int(n)) for r, n, _ in block[2 : count + 2].tolist()]
        return shared_episodes, {
            "segments": float(everyone[:, 0, 1].sum()),
            "members": float(everyone[:, 0, 2].sum()),
            "epoch": float(self.epoch_base + everyone[:, -1, 0].sum()),
            "staleness": float(everyone[:, 1, 2].max()),
            "trainer_wait_s": float(everyone[:, 1, 0].mean()),
            "rollout_wait_s": float(everyone[:, 1, 1].mean()),
        }

    def _train(self, segments: list[Segment]) -> dict[str, float]:
        assert self.optimizer is not None and self.trained is not None
        tick = time.perf_counter()
        self.exchange.before_optimizer_step()  # the bound agent is about to change
        self._fold_moments(segments)  # each segment's moments once, before they are shared
        if self.grid.tensor > 1:
            segments = share_segments(self.ctx, segments)
            self.lag = max(s.lag for s in segments)
        self.split_s["comm"] += time.perf_counter() - tick
        # Minibatch order is a function of (seed, replica, update): a resumed run shuffles as
        # the uninterrupted one would, with no generator state to carry.
        self.generator.manual_seed(
            (self.job.seed * 10_000 + self.replica_rank) * 1_000_003 + self.update)
        info = UpdateInfo(self.optimizer, self.generator, self.env_steps, self.update, self.lag)
        tick = time.perf_counter()
        losses = self.algorithm.update(self.trained.model, self.agent.net, segments, info)
        self.trained.publish()  # a sharded trainer's new weights, whole, into the agent
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
            members=int(row["members"]) if "members" in row else None,
        )

    def _should_checkpoint(self) -> bool:
        return bool(self.loop.checkpoint_every) and self.update % self.loop.checkpoint_every == 0

    def _save_checkpoint(self) -> None:
        if not self.is_trainer or self.optimizer is None or self.trained is None:
            return
        record: dict[str, Any] = dict(
            update=self.update, env_steps=self.env_steps, episodes=self.episodes,
            metrics=self.metrics, settings=self.settings, normalizers=self.agent.normalizers(),
            epoch=(int(self.metrics[-1].get("epoch", 0)) if self.elastic and self.metrics
                   else None))
        if self.trained.sharded:  # each trainer writes its own shards (checkpoints.py)
            save_sharded_checkpoint(self.job.run_dir, self.trained, self.optimizer,
                                    self.ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL), **record)
            return
        policy, optimizer = self.trained.state_dicts(self.optimizer)  # every trainer takes part
        if self.rank != 0:
            return
        save_checkpoint(self.job.run_dir, policy, optimizer, **record)

    def _maybe_resume(self) -> None:
        picked = resume_source(  # verified on load
            self.ctx, self.job, self.loop.resume,
            ParallelMode.TRAIN_DATA_PARALLEL if self.elastic else ParallelMode.GLOBAL)
        if picked is None:
            return
        source, state = picked.path, picked.state
        if self.trained is not None and self.optimizer is not None:
            if picked.sharded:  # resharded into this grid (checkpoints.py)
                load_sharded_checkpoint(source, self.trained, self.optimizer,
                                        self.ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL))
            else:
                self.trained.load(state["policy"], state["optimizer"], self.optimizer)
        elif not picked.sharded:  # a rollout rank: a sharded one's weights come with the first
            self.agent.net.load_state_dict(state["policy"])  # transfer, as they do anyway
        for name, value in state.get("normalizers", {}).items():
            self.agent.state_dict()[name].copy_(value)  # in place: the tensors are bound
        self.update, self.env_steps = state["update"], state["env_steps"]
        self.episodes = [(float(r), int(n)) for r, n in state["episodes"]]
        if state.get("epoch") is not None:  # a new epoch from whoever is there
            self.epoch_base = int(state["epoch"]) + 1
        torch.set_rng_state(state["torch_rng"])
        if source.resolve().is_relative_to(self.job.run_dir.resolve()):
            self.metrics = list(state["metrics"])  # same run: metrics.csv keeps every row
        log.info("resumed from %s at update %d (%d env steps)", source, self.update, self.env_steps)
