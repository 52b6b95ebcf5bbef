"""Rollout ranks beyond the plan under the Ray engine (``launcher.ray.max_rollouts``): the driver
adds a rollout actor whenever the cluster has free CPUs (and GPUs) for one more rank, up to that
many rollout ranks in all (docs/growth.md).

Each runs what ``python -m app.join RUN_DIR role=rollout`` runs, in its actor's child process
(app/launch/ray_rank.py): a new rank number, the trainer that leads the fewest rollout ranks
admits it at an update boundary, and it ends with the job. A grown actor that fails or is lost
is not the run's failure: it was never planned, and the membership drops it as any lost
rollout rank; the driver may start another while there is room.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any

from app.launch.environment import FORKSERVER_VARIABLE
from app.launch.jobfile import FINISHED, JOB_FILE
from app.launch.ray_cluster import kill_actor

GROW_EVERY_S = 2.0  # how often the driver asks Ray for free resources (one call to the GCS)
JOIN = "join"  # the payload's mark: the child runs python -m app.join's rank


class Growth:
    """The driver's rollout actors beyond the plan: how many may run, which do."""

    def __init__(self, actor_class: Any, settings: Any, planned_rollouts: int, run_dir: Path,
                 options: dict[str, Any], log: logging.Logger) -> None:
        self.actor_class, self.settings, self.run_dir = actor_class, settings, run_dir
        wanted = settings.max_rollouts
        self.room = 0 if wanted is None else max(0, int(wanted) - planned_rollouts)
        self.options, self.log = options, log
        self.running: dict[Any, Any] = {}  # a grown actor's run() call -> the actor
        self.started = 0
        self.next_look = 0.0
        self.payload = pickle.dumps((JOIN, str(run_dir)))

    def begin_attempt(self) -> None:
        """A new start of every rank: the last attempt's job.json names a store prefix no rank
        uses any more, so none joins until rank 0 writes this attempt's."""
        self.kill_all()
        (self.run_dir / JOB_FILE).unlink(missing_ok=True)

    def tick(self) -> None:
        """Once every GROW_EVERY_S: the grown actors that ended are let go, and one more is
        started where the cluster has room for it and the job admits joiners."""
        if not self.room or time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + GROW_EVERY_S
        self._collect()
        if len(self.running) >= self.room or not self._job_admits() or not self._fits():
            return
        self.started += 1
        actor = self.actor_class.options(
            num_cpus=self.settings.cpus_per_rank, num_gpus=self.settings.gpus_per_rank,
            max_concurrency=2, max_restarts=0, **self.options).remote(-self.started)
        environ = {k: v for k, v in os.environ.items() if k != FORKSERVER_VARIABLE}
        self.running[actor.run.remote(self.payload, environ, os.getcwd())] = actor
        self.log.warning("the cluster has room for one more rollout rank: starting a Ray actor "
                         "for it beyond the plan (%d running of launcher.ray.max_rollouts=%d "
                         "less the layout's)", len(self.running), self.settings.max_rollouts)

    def _job_admits(self) -> bool:
        """The job wrote job.json (its groups exist, joiners are admitted) and has not ended."""
        return (self.run_dir / JOB_FILE).exists() and not (self.run_dir / FINISHED).exists()

    def _fits(self) -> bool:
        import ray

        free = ray.available_resources()
        return (free.get("CPU", 0.0) >= self.settings.cpus_per_rank
                and free.get("GPU", 0.0) >= self.settings.gpus_per_rank)

    def _collect(self) -> None:
        """Grown actors that ended: a failure is said, not raised (see the module's doc)."""
        import ray
        from ray.exceptions import RayActorError

        done, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=0) \
            if self.running else ([], [])
        for ref in done:
            actor = self.running.pop(ref)
            try:
                status = int(ray.get(ref))
            except RayActorError as err:
                status, why = -1, f"its Ray actor died ({type(err).__name__})"
            else:
                why = f"exit code {status}"
            if status != 0:
                self.log.warning("a rollout rank beyond the plan ended: %s; the run goes on",
                                 why)
            kill_actor(actor)

    def signal(self, signum: int) -> None:
        for actor in self.running.values():
            actor.signal.remote(signum)

    def kill_all(self) -> None:
        for actor in self.running.values():
            kill_actor(actor)
        self.running = {}
