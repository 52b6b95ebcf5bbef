"""One rank's run: collect, hand off, train, record, until the stop rule fires.

The rank's parts come from app/runtime/compose.py: each role does its own step of an update
(the collector collects, the trainer trains, the decider records, checkpoints and checks the
target), and the hand-off moves what goes between ranks. A rank without a decider follows its
trainer, which tells it through the hand-off when the run stops. docs/how-a-rank-runs.md draws
it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from app.api import JobInfo
from app.output import timeline
from app.output.progress import StopRule
from app.runtime.checkpoints.checkpoint import Resumable
from app.runtime.checkpoints.checkpointer import is_own, note_resume, resume
from app.runtime.compose import Rank, build_rank
from app.runtime.core import stopping
from app.runtime.core.algorithm import Segment
from app.runtime.handoff import Round
from app.runtime.membership.healing import heal, settle
from app.runtime.membership.rollouts import ASKED
from app.runtime.membership.trainers import LeftWhenAsked
from app.runtime.records.recorder import Recorder, RecordsMark
from app.runtime.records.rows import Attempt, time_split
from app.runtime.roles.decider import Decider
from app.runtime.settings import RunSettings
from app.runtime.settings.builders import stop_rule, target, tracking
from rlcomm import CommContext

log = logging.getLogger(__name__)


def run_rank(loop: RunSettings, ctx: CommContext, job: JobInfo) -> dict[str, Any]:
    """This rank's run of ``loop``; its entry in result.json."""
    return RankRun(build_rank(loop, ctx, job)).run()


class RankRun:
    """The update loop over one rank's parts (:class:`~app.runtime.compose.Rank`)."""

    def __init__(self, rank: Rank) -> None:
        self.rank, self.state, self.hand_off = rank, rank.state, rank.hand_off
        self.loop = rank.loop
        self.decider: Decider | None = None

    def run(self) -> dict[str, Any]:
        # Asked to stop (SIGTERM), the deciding ranks stop where they agree, with a checkpoint;
        # a rank that follows its trainer is stopped by it (app/runtime/core/stopping.py).
        restore = stopping.listen(self.rank.job.stop_grace_s)
        try:
            return self._run()
        except BaseException:
            if stopping.asked():  # it was stopped: not a cause of the run's failure
                stopping.die()
            raise
        finally:
            restore()

    def _run(self) -> dict[str, Any]:
        rank = self.rank
        resumed = self._resume()
        first_update, first_steps = self.state.update, self.state.env_steps  # this attempt's start
        start, cpu_start = time.perf_counter(), time.process_time()
        self.state.attempt_start = start
        if rank.deciders is not None:
            self.decider = self._decider(resumed, (start, first_steps))
        try:
            self._loop()
        except LeftWhenAsked as left:  # the others go on: nothing of the run's stop is ours
            log.warning("%s; it ends here", left)
            stopping.reached()
            return self._left(start)
        except BaseException:
            if self.decider is not None:
                self.decider.close()
            raise
        stopping.reached()  # a stop asked ends here like any other: no grace any more
        timeline.mark("stop")
        self._wind_down()
        elapsed = time.perf_counter() - start
        cpu_s = time.process_time() - cpu_start
        if rank.collector is not None:
            rank.collector.close()
        attempt = Attempt(elapsed=elapsed, updates=self.state.update - first_update,
                          steps=self.state.env_steps - first_steps,
                          transfer_s=self.hand_off.stats.transfer_s,
                          wait_s=self.hand_off.stats.wait_total_s,
                          reached_at=self.state.reached_at,
                          recent=self.state.recent_return(self.loop.window))
        return self._result(attempt, cpu_s)

    def _wind_down(self) -> None:
        """The run stopped: the evaluation, the members and replay ranks told, the last
        checkpoint and the records closed."""
        rank = self.rank
        if self.decider is not None:
            self.decider.finish(rank.ctx.timeout.total_seconds())
        if rank.trainers is not None:
            rank.trainers.stop()
        self.hand_off.stop(self.state.update, self.state.env_steps)
        rank.replay_link.close()  # layout.replay's ranks serve until every rank said STOP
        if self.decider is not None:
            self.decider.save_final()
            self.decider.recorder.close(target(self.loop), self._title())

    def _left(self, start: float) -> dict[str, Any]:
        """This trainer was let go at its request: it stops its heartbeats and ends, without
        the job's figures (they are the others' now) or a word to its rollout ranks, which
        the lead dealt to the others (they follow them as after a lost trainer)."""
        rank = self.rank
        assert rank.trainers is not None
        rank.trainers.leave()
        if self.decider is not None:
            self.decider.close()
        if rank.collector is not None:
            rank.collector.close()
        return {"role": rank.job.plan.role(rank.ctx.get_global_rank()),
                "updates": self.state.update, "env_steps": self.state.env_steps,
                "wall_s": round(time.perf_counter() - start, 2), "left": ASKED,
                **rank.trainers.result()}

    def _loop(self) -> None:
        """Updates until the stop rule fires (or, on a rank that follows its trainer, until the
        trainer says so)."""
        rank, state, decider = self.rank, self.state, self.decider
        per_segment = self.loop.hparams.num_envs * self.loop.hparams.num_steps
        going = self._more_steps() and self._sync_weights(first=True)
        while going:
            if rank.trainers is not None:
                rank.trainers.start_update(state.update)
            version = self.hand_off.version(state.update)
            handed = self._collect(version)
            if handed is None:  # told by its trainer: the run stopped
                break
            state.learn(handed.episodes)
            if decider is not None:
                decider.share_evaluation(handed.shared)
            state.env_steps += int(handed.shared.pop("segments")) * per_segment
            losses = self._train(handed.segments) if rank.trainer is not None else {}
            self.hand_off.update_done()
            state.update += 1
            if rank.trainers is not None:
                self._trainers_changed()
            timeline.mark("first_update")  # the first time counts (app/output/timeline.py)
            if decider is not None and decider.after_update(
                    version, handed.episodes, losses, handed.shared,
                    self.hand_off.stats.transfer_s, handed.stop_asked):
                break  # the target is reached (loop.stop_at_target), or a stop was asked
            going = self._more_steps() and self._admit_trainers() and \
                self._sync_weights(first=False)
            if going and decider is not None:
                decider.evaluate(self.hand_off.version(state.update), rank.agent)

    def _decider(self, resumed: RecordsMark | None, started: tuple[float, int]) -> Decider:
        rank, loop = self.rank, self.loop
        assert rank.deciders is not None
        rule: StopRule | None = stop_rule(loop) if loop.progress else None
        trainers = rank.trainer.count if rank.trainer is not None else None
        recorder = Recorder(rank.ctx, rank.job.run_dir, self._name(), rank.algorithm.losses,
                            trainers, resumed, (rule, tracking(loop, self.state.resumed_from)),
                            title=self._title())
        if recorder.view is not None:
            self.hand_off.on_wait = recorder.waiting
        return Decider(loop, self.state, rank.deciders, recorder, rank.checkpointer,
                       rank.evaluations, started, votes_stop=rank.trainers.votes_stop
                       if rank.trainers is not None else stopping.asked)

    def _trainers_changed(self) -> None:
        """After an update: if a trainer was lost during it, the survivors agree on the state
        (app/runtime/membership/healing.py's ``settle``)."""
        rank = self.rank
        assert rank.trainers is not None and rank.checkpointer is not None
        if rank.trainers.update_done():
            settle(rank.ctx, rank.checkpointer, self.state, rank.trainers.lead)

    def _admit_trainers(self) -> bool:
        """At the update boundary: trainers that asked to join are admitted and healed from the
        lead (app/runtime/trainer/)."""
        rank = self.rank
        if rank.trainers is not None:
            assert rank.checkpointer is not None
            checkpointer, lead = rank.checkpointer, rank.trainers.lead
            rank.trainers.boundary(
                lambda joined: heal(rank.ctx, checkpointer, self.state, lead, joined))
        return True

    def _more_steps(self) -> bool:
        """Whether the run goes on (a follower: until its trainer stops it)."""
        return self.decider.more_steps() if self.decider is not None else True

    def _sync_weights(self, first: bool) -> bool:
        tick = time.perf_counter()
        going = self.hand_off.sync_weights(first=first)
        self.rank.split_s["comm"] += time.perf_counter() - tick
        return going

    def _collect(self, version: int) -> Round | None:
        """This rank's segment collected (if it collects) and handed off: what the update
        trains on and every finished episode; None once the run stopped."""
        rank = self.rank
        own, mine = rank.collector.collect(version) if rank.collector is not None else (None, [])
        tick = time.perf_counter()
        handed = self.hand_off.exchange(own, mine, self.state.update)
        rank.split_s["comm"] += time.perf_counter() - tick
        if handed is not None and "epoch" in handed.shared:
            handed.shared["epoch"] += self.state.epoch_base
            self.state.epoch = int(handed.shared["epoch"])
        return handed

    def _train(self, segments: list[Segment]) -> dict[str, float]:
        assert self.rank.trainer is not None
        tick = time.perf_counter()
        self.hand_off.before_optimizer_step()  # the bound agent is about to change
        self.rank.split_s["comm"] += time.perf_counter() - tick
        return self.rank.trainer.train(segments, self.state)

    def _resume(self) -> RecordsMark | None:
        """The checkpoint the run resumes from, if any, into this rank (a replay rank's shard
        too: then it serves); where this run's records stood at it, when it is this run's own
        (a restart: the history files go on from there)."""
        picked = self._picked()
        rank = self.rank
        rank.replay_link.begin(picked.path if picked is not None else None,
                               int(picked.state["update"]) if picked is not None else 0)
        if picked is None or rank.deciders is None or not is_own(picked, rank.job):
            return None
        return RecordsMark.of_checkpoint(picked.state, rank.job.run_dir)

    def _picked(self) -> Resumable | None:
        rank = self.rank
        if rank.deciders is None:
            return note_resume(rank.ctx, rank.job, self.loop.resume)
        if rank.trainers is not None and rank.trainers.joining:  # from a live trainer instead
            assert rank.checkpointer is not None
            heal(rank.ctx, rank.checkpointer, self.state, rank.trainers.lead,
                 [rank.ctx.get_global_rank()])
            return None
        return resume(rank.ctx, rank.job, self.loop.resume, rank.deciders, rank.checkpointer,
                      rank.agent, self.state)

    def _name(self) -> str:
        return type(self.rank.algorithm).__name__.lower()

    def _title(self) -> str:
        """The run's name on its learning curve and in its trackers: ``ppo CartPole-v1``."""
        return f"{self._name()} {self.loop.env.id}"

    def _result(self, attempt: Attempt, cpu_s: float) -> dict[str, Any]:
        """This rank's entry in result.json."""
        rank, hand_off, elapsed = self.rank, self.hand_off, attempt.elapsed
        stats = hand_off.stats
        common = {
            "role": rank.job.plan.role(rank.ctx.get_global_rank()), "updates": self.state.update,
            "env_steps": self.state.env_steps,
            "wall_s": round(elapsed, 2),
            "env_steps_per_s": round(attempt.steps / elapsed, 1) if elapsed else 0.0,
            "weights_version": hand_off.version(self.state.update),
            "hand_off": hand_off.kind,
            "trajectory_bytes_sent": stats.trajectory_bytes_sent,
            "wait_fraction": round(stats.wait_total_s / elapsed, 4) if elapsed else 0.0,
            "time_split_s": time_split(rank.split_s, elapsed),
            "cpu_s": round(cpu_s, 3),  # this process's CPU time over the run (all threads)
            "threads": torch.get_num_threads(),
            "param_checksum": float(sum(p.detach().double().sum()
                                        for p in rank.agent.net.parameters())),
            **rank.replay_link.result(),
            **(rank.trainers.result() if rank.trainers is not None else {}),
        }
        membership = hand_off.result()
        if self.decider is None:  # the job's counts come from its trainer: its own beside them
            return {**common, **membership, "env_steps_collected": attempt.steps}
        if "epoch" in membership:
            membership["epoch"] += self.state.epoch_base
        decided = self.decider.result(attempt, type(self.loop).metrics.directions)
        return {
            **common,
            "weight_bytes_sent": stats.weight_bytes_sent,
            "max_staleness": self.loop.max_staleness,
            **({"staleness_histogram": {str(k): n for k, n in sorted(stats.staleness.items())}}
               if rank.trainer is not None else {}),
            **decided,
            **membership,
        }
