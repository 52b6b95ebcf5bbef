"""One rank's run: collect, hand off, train, record, until the stop rule fires.

Every rank runs the same steps per update; its role decides which steps do work (rollouts
collect, trainers train, colocated ranks do both). What moves between trainers and rollout ranks goes through one
hand-off (app/runtime/handoff/), the kind the plan calls for. The stop decision is taken from
the episodes the deciding ranks share, so they all stop at the same update; an
elastic run's rollout ranks learn it from their trainer. The algorithm only acts (in the
worker) and updates (here, on trainers); everything else is this module's.
"""

from __future__ import annotations

import copy
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
from app.runtime.checkpoints.checkpoint import (
    load_sharded_checkpoint,
    resume_source,
    run_settings,
    save_checkpoint,
)
from app.runtime.checkpoints.shards import save_sharded_checkpoint
from app.runtime.evaluation.evaluator import Evaluations, evaluation_row
from app.runtime.handoff import HandOffSettings, Round, build_hand_off
from app.runtime.records import (
    MetricsFile,
    declared_figures,
    job_metrics,
    replay_result,
    time_split,
    update_row,
)
from app.runtime.replay.service import ReplayLink, collectors
from app.runtime.seeds import env_seed, minibatch_seed
from app.runtime.segments import with_episodes
from app.runtime.sharding import (
    TrainedModule,
    TrainerGrid,
    is_sharded,
    replica_rank,
    share_replica_segments,
)
from app.runtime.worker import Agent, Episode, RolloutWorker, build_segment_format
from rlcomm import CommContext, ParallelMode, collectives

if TYPE_CHECKING:
    from app.runtime.loop import RLLoop

log = logging.getLogger(__name__)


class RuntimeRun:
    """One rank's state for one run of an :class:`RLLoop`."""

    def __init__(self, loop: RLLoop, ctx: CommContext, job: JobInfo) -> None:
        self.loop, self.ctx, self.job, self.hparams, plan = loop, ctx, job, loop.hparams, job.plan
        self.rank = ctx.get_global_rank()
        self.is_trainer = self.rank in plan.trainers
        self.collects = (plan.colocated and self.is_trainer) or self.rank in plan.rollouts
        self.has_rollout_ranks = not plan.colocated
        # Rollout ranks may leave and join (app/runtime/handoff/elastic.py); such a rank follows
        # its trainer, which tells it when the run stops.
        self.elastic = self.has_rollout_ranks and plan.elastic_rollouts
        self.follows = self.elastic and not self.is_trainer
        self.epoch_base = 0  # a resumed run's epochs count on from its checkpoint's
        if loop.threads:  # else the launcher's: the node's cores over its ranks (app/launch/rank.py)
            torch.set_num_threads(loop.threads)
        torch.manual_seed(job.seed)  # same initial weights on every rank
        # As the launcher probed them (they travel with the loop); else one env, built and closed.
        self.spaces = loop.spaces
        self.algorithm = loop.build_algorithm(self.spaces)
        # What the rollouts act with, and what the weights carry: the policy (the algorithm's
        # module, or loop.model's) and the normalisers' statistics.
        self.agent = Agent(loop.build_policy(self.algorithm, self.spaces), self.spaces,
                           loop.env, context=loop.model.history)
        episode_cap = self.hparams.num_envs * (self.hparams.num_steps // 8 + 1)
        self.segment_format = build_segment_format(self.algorithm, self.spaces, self.agent,
                                     self.hparams.num_steps, self.hparams.num_envs)
        if self.elastic:  # a member's episodes travel in its segment
            self.segment_format = with_episodes(self.segment_format, episode_cap)
        self.worker = (RolloutWorker(self.algorithm, self.spaces, loop.env, self.agent,
                                     seed=env_seed(job.seed, self.rank))
                       if self.collects else None)
        if self.worker is not None:  # which collector it is, for per-collector exploration
            self.worker.use_segment_format(self.segment_format)
            self.algorithm.set_collector(collectors(plan).index(self.rank), len(collectors(plan)))
        self.grid = TrainerGrid.of(plan)
        self.settings = run_settings(loop, self.spaces)  # what a checkpoint records
        self.generator = torch.Generator()
        # A sharded trainer's copy comes first: a sharded hand-off sends its shards. DDP wraps
        # the acting module itself, only once a flat or elastic hand-off bound it to its send
        # buffer (the parameters then live there).
        sharded = is_sharded(plan, loop.data_parallel)
        self.trained = self._trained_module() if sharded else None
        link = self.replay_link = ReplayLink(ctx, plan, self.algorithm, self.segment_format, job.seed)
        self.hand_off = build_hand_off(ctx, job, self.agent, link.hand_off_format, self.trained,
                                       self._hand_off_settings(episode_cap, sharded), link.served)
        if not sharded:
            self.trained = self._trained_module()
        self.optimizer = (self.algorithm.optimizer(self.trained.trained)
                          if self.trained is not None else None)
        # The ranks of one TENSOR x SEQUENCE block train one replica on the same batch, in the
        # same minibatch order: they seed it from the block's first rank.
        self.replica_rank = replica_rank(plan, self.rank) if self.is_trainer else self.rank
        self.update = 0
        self.env_steps = 0
        self.episodes: list[Episode] = []
        self.lag = 0  # the version lag of the data being trained on
        self.metrics: list[dict[str, float]] = []  # one row per update (metrics.csv)
        self.metrics_file: MetricsFile | None = None  # rank 0's, written through per update
        # Measured seconds of this attempt: collecting (the worker splits out env stepping and
        # the policy's forward), the update, and communication (time_split_s in the result).
        self.split_s = {"collect": 0.0, "update": 0.0, "comm": 0.0}
        self.evaluations = self._start_evaluations()

    def run(self) -> dict[str, Any]:
        self._maybe_resume()
        if self.rank == 0 and self.is_trainer:
            self.metrics_file = MetricsFile(self.job.run_dir / "metrics.csv", self.metrics)
        first_update, first_steps = self.update, self.env_steps  # this attempt's start
        start, cpu_start = time.perf_counter(), time.process_time()
        rule = self.loop.stop_rule()
        view = RunProgress(rule, self._name()) if self._writes_outputs(self.loop.progress) else None
        scalars = (ScalarLog(self.job.run_dir, self._name())
                   if self._writes_outputs(self.loop.tensorboard) else None)
        self.hand_off.on_wait = view.waiting if view is not None else None
        try:
            reached_at = self._loop(start, first_steps, view, scalars)
        except BaseException:
            if self.evaluations is not None:
                self.evaluations.close()
            raise
        timeline.mark("stop")
        if self.evaluations is not None:  # the one still running completes the record
            self.evaluations.finish(self.ctx.timeout.total_seconds())
        self.hand_off.stop(self.update, self.env_steps)
        self.replay_link.close()  # layout.replay's ranks serve until every rank said STOP
        if self.loop.checkpoint_every and self.update % self.loop.checkpoint_every:
            self._save_checkpoint()  # keep the final state too
        if view is not None:
            view.close()  # after the last checkpoint notice: the bar is the run's last line
        if scalars is not None:  # written before success is reported (app/launch/rank.py)
            in_background(scalars.close, name="TensorBoard scalars")
        elapsed = time.perf_counter() - start
        cpu_s = time.process_time() - cpu_start
        self._draw_learning_curve()
        if self.worker is not None:
            self.worker.close()
        return self._result(elapsed, cpu_s, self.update - first_update,
                            self.env_steps - first_steps, reached_at)

    def _loop(self, start: float, first_steps: int, view: RunProgress | None,
              scalars: ScalarLog | None) -> tuple[float, int] | None:
        """Updates until the stop rule fires (or, on a rollout rank that follows its trainer,
        until the trainer says so); returns when and at how many env steps the target was
        reached, if it was."""
        reached_at: tuple[float, int] | None = None
        target = self.loop.target()  # with loop.stop_at_target=false: noted, not the end
        going = self._more_steps() and self._sync_weights(first=True)
        while going:
            version = self.hand_off.version(self.update)
            handed = self._collect(version)
            if handed is None:  # told by its trainer: the run stopped
                break
            self.episodes.extend(handed.episodes)
            if self.evaluations is not None:  # after the hand-off: every decider is here
                handed.shared.update(evaluation_row(self.evaluations.share()))
            collected = int(handed.shared.pop("segments"))
            self.env_steps += collected * self.hparams.num_envs * self.hparams.num_steps
            losses = self._train(handed.segments) if self.is_trainer else {}
            self.hand_off.update_done()
            self.update += 1
            timeline.mark("first_update")  # the first time counts (app/output/timeline.py)
            if not self.follows:
                elapsed = time.perf_counter() - start
                row = self._record(version, handed.episodes, losses, handed.shared,
                                   self.env_steps - first_steps, elapsed)
                self._show(row, elapsed, view, scalars)
                if self._should_checkpoint():
                    self._save_checkpoint()
                if reached_at is None and target is not None and self._stop_quantity() >= target:
                    reached_at = (time.perf_counter() - start, self.env_steps)
                    if self.loop.stop_at_target:
                        break
            going = self._more_steps() and self._sync_weights(first=False)
            if going and self.evaluations is not None and self.update % self.loop.eval_every == 0:
                self._submit_evaluation()
        return reached_at

    def _start_evaluations(self) -> Evaluations | None:
        """``loop.eval_every``: beside training, in the lead trainer's background process."""
        if not self.loop.eval_every or self.follows:
            return None
        return Evaluations(self.loop, self.ctx, min(self.job.plan.trainers), self._deciders,
                           self.job.run_dir)

    @property
    def _deciders(self) -> ParallelMode:
        """The ranks that take the stop decision (and share the job's figures): every rank, or
        an elastic run's trainers (its rollout ranks follow)."""
        return ParallelMode.TRAIN_DATA_PARALLEL if self.elastic else ParallelMode.GLOBAL

    def _stop_quantity(self) -> float:
        """What the target is compared with (``loop.stop_on``)."""
        if self.loop.stop_on == "eval" and self.evaluations is not None:
            return self.evaluations.latest_return
        return self._recent_return()

    def _submit_evaluation(self) -> None:
        """The weights just sent (with the normalisers' statistics) to the evaluator; with
        them, what ``checkpoints/best`` would hold (flat trainers: a sharded one keeps none)."""
        assert self.evaluations is not None
        if self.evaluations.process is None:
            return
        record = None
        if self.trained is not None and not self.trained.sharded and self.optimizer is not None:
            record = self._checkpoint_record()
            record["policy"] = {k: v.clone() for k, v in self.agent.net.state_dict().items()}
            record["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        self.evaluations.submit(self.hand_off.version(self.update), self.update,
                                self.env_steps, self.agent.state_dict(), record)

    def _more_steps(self) -> bool:
        """Whether the run goes on (a follower: until its trainer stops it)."""
        return self.follows or self.env_steps < self.loop.total_env_steps

    def _show(self, row: dict[str, float], elapsed: float, view: RunProgress | None,
              scalars: ScalarLog | None) -> None:
        if scalars is not None:
            scalars.write({**row, "mean_return_window": self._recent_return()}, self.env_steps)
        if view is not None:
            view.update(self._snapshot(row, elapsed))

    def _draw_learning_curve(self) -> None:
        if self.metrics_file is None:
            return
        self.metrics_file.close()
        if self.metrics:
            in_background(pictures.draw, plot_learning_curve, self.metrics_file.path,
                          self.job.run_dir / "learning_curve.png", self.loop.target(),
                          f"{self._name()} {self.loop.env.id}", name="learning curve")

    def _result(self, elapsed: float, cpu_s: float, updates: int, steps: int,
                reached_at: tuple[float, int] | None) -> dict[str, Any]:
        """This rank's entry in result.json."""
        hand_off = self.hand_off
        common = {
            "role": self.job.plan.role(self.rank), "updates": self.update,
            "env_steps": self.env_steps,
            "wall_s": round(elapsed, 2),
            "env_steps_per_s": round(steps / elapsed, 1) if elapsed else 0.0,
            "weights_version": hand_off.version(self.update),
            "hand_off": hand_off.kind,
            "trajectory_bytes_sent": hand_off.trajectory_bytes_sent,
            "wait_fraction": round(hand_off.wait_total_s / elapsed, 4) if elapsed else 0.0,
            "time_split_s": time_split(self.worker, self.split_s, elapsed),
            "cpu_s": round(cpu_s, 3),  # this process's CPU time over the run (all threads)
            "threads": torch.get_num_threads(),
            "param_checksum": float(sum(p.detach().double().sum()
                                        for p in self.agent.net.parameters())),
            **self.replay_link.result(),
        }
        if self.follows:  # the job's counts come from its trainer: this rank's own beside them
            return {**common, **hand_off.result(), "env_steps_collected": steps}
        metrics = job_metrics(
            self.ctx, self.is_trainer, elapsed=elapsed, transfer_s=hand_off.transfer_s,
            wait_s=hand_off.wait_total_s, reached_at=reached_at, updates=updates, steps=steps,
            recent=self._recent_return(), over=self._deciders,
        )
        if self.elastic and elapsed:  # the rollout ranks' waits came with their segments
            waited = sum(row["rollout_wait_s"] for row in self.metrics[-updates:] if updates)
            metrics["rollout_wait_fraction"] = round(waited / elapsed, 4)
        evaluated = self.evaluations.result() if self.evaluations is not None else {}
        metrics.update(evaluated.pop("metrics", dict.fromkeys(("eval_return_mean",
                                                               "best_eval_return"))))
        membership = hand_off.result()
        if "epoch" in membership:
            membership["epoch"] += self.epoch_base
        return {
            **common,
            "episodes": len(self.episodes),
            "mean_return_last_window": round(self._recent_return(), 2),
            "reached_target": reached_at is not None,
            "time_to_target_s": round(reached_at[0], 2) if reached_at else None,
            "env_steps_to_target": reached_at[1] if reached_at else None,
            "weight_bytes_sent": hand_off.weight_bytes_sent,
            "max_staleness": self.loop.max_staleness,
            **({"staleness_histogram": {str(k): n for k, n in sorted(hand_off.staleness.items())}}
               if self.is_trainer else {}),
            "metrics": {**metrics, **declared_figures(type(self.loop).metrics.directions,
                                                      self.algorithm.losses, self.metrics)},
            **replay_result(self.metrics),
            **evaluated,
            **membership,
        }

    def _hand_off_settings(self, episode_cap: int, sharded: bool) -> HandOffSettings:
        loop = self.loop
        return HandOffSettings(max_staleness=loop.max_staleness,
                               verify_every=loop.verify_weights_every,
                               min_rollouts=loop.min_rollouts,
                               timeout_s=self.ctx.timeout.total_seconds(),
                               episode_cap=episode_cap, sharded=sharded,
                               rollout_restarts=self.job.rollout_restarts)

    def _trained_module(self) -> TrainedModule | None:
        """What this rank trains (docs/sharding.md); None on a rollout rank."""
        if not self.is_trainer:
            return None
        return TrainedModule(self.ctx, self.job.plan, self.agent.net, self.loop.data_parallel)

    def _sync_weights(self, first: bool) -> bool:
        tick = time.perf_counter()
        going = self.hand_off.sync_weights(first=first)
        self.split_s["comm"] += time.perf_counter() - tick
        return going

    def _name(self) -> str:
        return type(self.algorithm).__name__.lower()

    def _collect(self, version: int) -> Round | None:
        """This rank's segment collected (if it collects) and handed off: what the update
        trains on and every finished episode; None once the run stopped."""
        own: torch.Tensor | None = None
        mine: list[Episode] = []
        if self.worker is not None:
            tick = time.perf_counter()
            own, mine = self.worker.collect(self.agent, version)
            self.split_s["collect"] += time.perf_counter() - tick
        tick = time.perf_counter()
        own = self.replay_link.put(own)  # to its replay rank (layout.replay)
        handed = self.hand_off.exchange(own, mine, self.update)
        self.split_s["comm"] += time.perf_counter() - tick
        if handed is not None:
            self.lag = max((s.lag for s in handed.segments), default=0)
            if "epoch" in handed.shared:
                handed.shared["epoch"] += self.epoch_base
        return handed

    def _train(self, segments: list[Segment]) -> dict[str, float]:
        assert self.optimizer is not None and self.trained is not None
        tick = time.perf_counter()
        self.hand_off.before_optimizer_step()  # the bound agent is about to change
        self._fold_moments(segments)  # each segment's moments once, before they are shared
        if self.grid.replica_size > 1:
            segments = share_replica_segments(self.ctx, self.grid, segments)
            self.lag = max(s.lag for s in segments)
        self.split_s["comm"] += time.perf_counter() - tick
        # Minibatch order is a function of (seed, replica, update): a resumed run shuffles as
        # the uninterrupted one would, with no generator state to carry.
        self.generator.manual_seed(minibatch_seed(self.job.seed, self.replica_rank, self.update))
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
            transfer_s=self.hand_off.transfer_s, shared=shared, losses=losses,
        )
        self.metrics.append(row)
        if self.metrics_file is not None:
            self.metrics_file.append(row)
        return row

    def _writes_outputs(self, enabled: bool) -> bool:
        return enabled and self.rank == 0

    def _snapshot(self, row: dict[str, float], elapsed: float) -> Snapshot:
        last = self.evaluations.done[-1] if self.evaluations and self.evaluations.done else None
        return Snapshot(
            env_steps=self.env_steps,
            mean_return=self._recent_return(),
            episodes=len(self.episodes),
            env_steps_per_s=row["env_steps_per_s"],
            weights_version=int(row["weights_version"]),
            elapsed_s=elapsed,
            members=int(row["members"]) if "members" in row else None,
            eval_return=last.return_mean if last else None,
            eval_version=last.version if last else None,
            replay_size=int(row["replay_size"]) if "replay_size" in row else None,
            samples_per_insert=row.get("samples_per_insert"),
            limiter_wait_s=((row["collector_wait_s"], row["learner_wait_s"])
                            if "collector_wait_s" in row else None),
        )

    def _should_checkpoint(self) -> bool:
        return bool(self.loop.checkpoint_every) and self.update % self.loop.checkpoint_every == 0

    def _save_checkpoint(self) -> None:
        if not self.is_trainer or self.optimizer is None or self.trained is None:
            return
        record = self._checkpoint_record()
        if self.trained.sharded:  # each trainer writes its own shards (checkpoints/shards.py)
            save_sharded_checkpoint(self.job.run_dir, self.trained, self.optimizer,
                                    self.ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL), **record)
            return
        policy, optimizer = self.trained.state_dicts(self.optimizer)  # every trainer takes part
        if self.rank != 0:
            return
        save_checkpoint(self.job.run_dir, policy, optimizer, **record)

    def _checkpoint_record(self) -> dict[str, Any]:
        """What a checkpoint holds besides the policy and the optimizer, as of now (copies)."""
        record: dict[str, Any] = dict(
            update=self.update, env_steps=self.env_steps, episodes=list(self.episodes),
            metrics=list(self.metrics), settings=self.settings,
            normalizers={k: v.clone() for k, v in self.agent.normalizers().items()},
            epoch=(int(self.metrics[-1].get("epoch", 0)) if self.elastic and self.metrics
                   else None))
        own = self.algorithm.state_dict()  # an off-policy algorithm's (never sharded trainers)
        if own:
            record["algorithm"] = copy.deepcopy(own)
        return record

    def _maybe_resume(self) -> None:
        if self.follows:  # the trainer's weights and statistics come with the first transfer
            self._note_resume()
            return
        picked = resume_source(  # verified on load
            self.ctx, self.job, self.loop.resume,
            ParallelMode.TRAIN_DATA_PARALLEL if self.elastic else ParallelMode.GLOBAL)
        if picked is None:
            return
        source, state = picked.path, picked.state
        if self.trained is not None and self.optimizer is not None:
            if picked.sharded:  # resharded into this grid (checkpoints/checkpoint.py)
                load_sharded_checkpoint(source, self.trained, self.optimizer,
                                        self.ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL))
            else:
                self.trained.load(state["policy"], state["optimizer"], self.optimizer)
        elif not picked.sharded:  # a rollout rank: a sharded one's weights come with the first
            self.agent.net.load_state_dict(state["policy"])  # transfer, as they do anyway
        if self.is_trainer and "algorithm" in state:
            self.algorithm.load_state_dict(state["algorithm"])
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

    def _note_resume(self) -> None:
        """A rollout rank that follows its trainer: where the run resumed, if it did, by this
        rank's own restart count (a joiner replaces a lost rank of the running job: none)."""
        if self.job.joining:
            return
        picked = resume_source(self.ctx, self.job, self.loop.resume, over=None)
        if picked is not None:
            log.info("resumed from %s at update %d (%d env steps)", picked.path,
                     picked.state["update"], picked.state["env_steps"])
