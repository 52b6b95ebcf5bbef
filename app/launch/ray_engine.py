"""The Ray engine (:class:`RayLauncher`, ``launcher.engine=ray``): ``python -m app`` is the
driver of a Ray job that starts each rank as a Ray actor and waits for them.

- **Cluster.** ``launcher.ray.address`` (null: a local Ray started for this run and stopped
  with it); placement groups per role, with ``launcher.ray.cpus_per_rank`` and
  ``gpus_per_rank`` per rank (app/launch/ray_cluster.py).
- **Rendezvous.** The driver serves the store, bound once to a port the kernel picks; every
  rank is a client, as under torchrun's agent, so no rank holds it.
- **Ranks.** Each actor runs its rank in a child process with the local launcher's rank code
  (app/launch/ray_rank.py): the same logs, ``rlcomm-rank<N>`` names, signals and result.
- **Losses.** A rank whose actor dies (``ray.kill``, a lost node) or whose process fails is
  lost. An elastic rollout rank or trainer leaves the membership as under the local launcher
  (its heartbeats stop) and is replaced by a new actor on its bundle while
  ``launcher.rollout_restarts`` / ``trainer_restarts`` allow; any other loss stops every rank
  and ends the run in one line, or starts them all again under ``launcher.max_restarts``.
- **The driver's end.** Its actors belong to its Ray job: Ray ends them when the driver ends,
  however it ends (a local Ray goes with its driver), and each rank ends with its actor.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.errors import LaunchInterruptedError, RankFailedError
from app.launch import ray_cluster, ray_reaper, slots
from app.launch.environment import ENGINE_VARIABLE, FORKSERVER_VARIABLE
from app.launch.failures import read_records
from app.launch.local import launcher_log, read_result
from app.launch.ray_growth import Growth
from app.output import timeline
from rlcomm.net.env import (
    LOCAL_RANK,
    LOCAL_WORLD_SIZE,
    MASTER_ADDR,
    MASTER_PORT,
    MAX_RESTARTS,
    RANK,
    RESTART_COUNT,
    USE_AGENT_STORE,
    WORLD_SIZE,
)

if TYPE_CHECKING:
    from app.api import RankEnv
    from app.launch.planning import ValidatedJob
    from rlcomm import LayoutPlan

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_POLL_S = 0.2  # how often the driver looks at signals between Ray's answers
PLACEMENT_FILE = "placement.json"  # where each rank's actor landed, as Ray reports it


class RayLauncher:
    """Starts every rank as a Ray actor and waits for them (the
    :class:`app.launch.launcher.Launcher` contract): ``python -m app launcher.engine=ray``."""

    name = "ray"
    starts_ranks = True

    def claims(self, env: RankEnv, engine: str) -> bool:
        return not env.joins and engine == "ray"

    def launch(self, job: ValidatedJob, plan: LayoutPlan, run_dir: Path) -> dict[str, Any]:
        logging.getLogger("app").info("starting %d ranks as Ray actors; run dir %s",
                                      plan.world_size, run_dir)
        return launch_on_ray(job, plan, run_dir)


def launch_on_ray(job: ValidatedJob, plan: LayoutPlan, run_dir: Path) -> dict[str, Any]:
    """Runs every rank on Ray; rank 0's summary, or RankFailedError / LaunchInterruptedError."""
    ray_cluster.quiet_console()  # before Ray reads its settings, at its import
    import ray

    settings = job.launcher.ray
    reaper = ray_cluster.connect(settings, plan.world_size, float(job.comm.timeout))
    started_here = reaper is not None
    timeline.mark("ray_connected")
    placement = None
    try:
        ray_cluster.check_fits(settings, plan.world_size, started_here)
        placement = ray_cluster.place(plan, settings)
        timeline.mark("placed")
        host = ray_cluster.store_host(started_here)
        store, port = ray_cluster.serve_store(host, float(job.comm.timeout))
        try:
            return Driver(job, plan, run_dir, placement, (host, port)).run()
        finally:
            del store  # closed here, after every rank ended
    finally:
        if placement is not None:
            placement.remove()
        ray.shutdown()
        if reaper is not None:  # the local Ray is gone: nothing left for it to end
            reaper.kill()
            reaper.wait()
            os.environ.pop(ray_reaper.TOKEN_VARIABLE, None)


class Driver:
    """The driver's part: the actors of each attempt, their losses, signals."""

    def __init__(self, job: ValidatedJob, plan: LayoutPlan, run_dir: Path,
                 placement: ray_cluster.Placement, store: tuple[str, int]) -> None:
        import ray

        from app.launch.ray_rank import RankActor

        self.job, self.plan, self.run_dir = job, plan, run_dir
        self.placement, self.store = placement, store
        self.log = launcher_log()
        self.actor_class = ray.remote(RankActor)
        self.runtime_env = _runtime_env()
        self.payload = pickle.dumps((job, plan, str(run_dir)))
        self.run_id = f"rlcomm-{uuid.uuid4().hex[:8]}"
        self.actors: dict[int, Any] = {}
        self.pending: dict[Any, int] = {}  # a rank's run() call -> the rank
        self.where: dict[int, dict[str, Any]] = {}
        self.replaced: dict[int, int] = {}  # rank -> replacements started
        self.started: dict[int, float] = {}  # rank -> when its current process was asked for
        self.attempt = 0
        self.attempt_start = time.time()
        self.signalled: int | None = None
        self.growth = Growth(self.actor_class, job.launcher.ray, len(plan.rollouts), run_dir,
                             {"runtime_env": self.runtime_env}, self.log)

    def run(self) -> dict[str, Any]:
        previous = {s: signal.signal(s, self._on_stop) for s in _STOP_SIGNALS}
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_dump)
        try:
            limit = int(self.job.launcher.max_restarts)
            while True:
                failure = self._attempt()
                if failure is None:
                    return read_result(self.run_dir)
                if self.attempt >= limit:
                    raise RankFailedError(f"{failure} (logs: {self.run_dir / 'logs'})")
                self.attempt += 1
                self.log.warning("%s; starting every rank again (%d of launcher.max_restarts=%d)",
                                 failure, self.attempt, limit)
        finally:
            self._kill_all()
            for signum, handler in previous.items():
                if handler is not None:
                    signal.signal(signum, handler)

    def _attempt(self) -> str | None:
        """One start of every rank, to its end; the failure that ended it, or None."""
        import ray

        self.attempt_start = time.time()
        self.replaced = {}  # every rank starts afresh: its restarts too, as a new slot's
        self.growth.begin_attempt()
        self.actors = {rank: self._new_actor(rank) for rank in range(self.plan.world_size)}
        self.where = self._where_actors_are()
        self._write_placement()
        timeline.export()  # the Ray marks too, for rank 0's timeline
        self.pending = {self._start(rank): rank for rank in self.actors}
        while self.pending:
            self._take_signal()
            if self._stragglers_ended():
                return None
            self.growth.tick()  # launcher.ray.max_rollouts: one more rollout rank, with room
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=_POLL_S)
            for ref in ready:
                rank = self.pending.pop(ref)
                ended = self._why_ended(ref, rank)
                if ended is None:
                    continue
                why, own_error = ended
                failure = (f"rank {rank} ({self.plan.role(rank)}) failed: {why}" if own_error
                           else self._lost(rank, why))
                if failure is not None:
                    self._stop_all(signal.SIGTERM)
                    return failure
        return None

    def _where_actors_are(self) -> dict[int, dict[str, Any]]:
        """Each actor's node, once every actor started; one line where one cannot start."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        asked = {rank: actor.where.remote() for rank, actor in self.actors.items()}
        where: dict[int, dict[str, Any]] = {}
        for rank, ref in asked.items():
            try:
                where[rank] = ray.get(ref, timeout=float(self.job.comm.timeout))
            except (RayActorError, GetTimeoutError) as err:
                self._kill_all()
                raise RankFailedError(
                    f"rank {rank} ({self.plan.role(rank)}): its Ray actor did not start within "
                    f"comm.timeout={self.job.comm.timeout:g} s ({ray_cluster.gist(err)})") from None
        return where

    def _finished_at(self) -> float | None:
        """When rank 0 wrote this attempt's ``result.json`` (the run's last step), or None."""
        try:
            written = (self.run_dir / "result.json").stat().st_mtime
        except OSError:
            return None
        return written if written >= self.attempt_start else None

    def _stragglers_ended(self) -> bool:
        """Ranks still running ``2 x launcher.shutdown_timeout`` after the run's end (a rank
        that does not exit, a replacement Ray never placed) are ended, as the local launcher
        ends them: True once done, and the run has succeeded."""
        finished = self._finished_at()
        bound = 2 * float(self.job.launcher.shutdown_timeout)
        if finished is None or time.time() - finished < bound:
            return False
        self.log.warning("rank(s) %s still running %.0f s after the run ended (result.json); "
                         "ending them", sorted(set(self.pending.values())),
                         time.time() - finished)
        self._kill_all()
        return True

    def _new_actor(self, rank: int) -> Any:
        settings = self.job.launcher.ray
        return self.actor_class.options(
            num_cpus=settings.cpus_per_rank, num_gpus=settings.gpus_per_rank,
            max_concurrency=2,  # signal() while run() waits
            max_restarts=0, scheduling_strategy=self.placement.strategy(rank),
            runtime_env=self.runtime_env,
            name=self._name(rank),
        ).remote(rank)

    def _name(self, rank: int) -> str:
        """The actor's name in the ``rlcomm`` namespace: run, rank, attempt and replacement."""
        return f"{self.run_id}-rank{rank}-{self.attempt}.{self.replaced.get(rank, 0)}"

    def _start(self, rank: int) -> Any:
        self.started[rank] = time.time()
        return self.actors[rank].run.remote(self.payload, self._environ(rank), os.getcwd())

    def _environ(self, rank: int) -> dict[str, str]:
        """What rank ``rank`` sees: the driver's environment, and the variables torchrun's agent
        would give it, its store the driver's."""
        ip = self.where.get(rank, {}).get("ip")
        on_host = sorted(r for r, w in self.where.items() if w.get("ip") == ip) or [rank]
        hosts = sorted({w.get("ip") for w in self.where.values()}, key=str)
        environ = {k: v for k, v in os.environ.items() if k != FORKSERVER_VARIABLE}
        environ.update({
            ENGINE_VARIABLE: "ray", RANK: str(rank), WORLD_SIZE: str(self.plan.world_size),
            LOCAL_RANK: str(on_host.index(rank)), LOCAL_WORLD_SIZE: str(len(on_host)),
            "GROUP_RANK": str(hosts.index(ip) if ip in hosts else 0), "ROLE_RANK": str(rank),
            MASTER_ADDR: self.store[0], MASTER_PORT: str(self.store[1]),
            "TORCHELASTIC_RUN_ID": self.run_id, USE_AGENT_STORE: "True",
            RESTART_COUNT: str(self.attempt), MAX_RESTARTS: str(self.job.launcher.max_restarts),
        })
        if self.replaced.get(rank):
            environ[slots.INCARNATION_VARIABLE] = str(self.replaced[rank])
        return environ

    def _why_ended(self, ref: Any, rank: int) -> tuple[str, bool] | None:
        """None for a rank that finished; else why it ended, in a few words, and whether it
        failed on its own error (a failure record other than a lost peer's, as a slot tells
        them apart: app/launch/slots.py), which no replacement would fix."""
        import ray
        from ray.exceptions import RayActorError

        try:
            status = int(ray.get(ref))
        except RayActorError as err:
            return f"its Ray actor died ({ray_cluster.gist(err)})", False
        if status == 0:
            return None
        record = read_records(self.run_dir / "logs").get(rank)
        if record is not None and record.time >= self.started[rank]:  # this start's own
            return record.summary, slots.failed_on_its_own(status, record)
        if status < 0:
            return f"killed by {signal.Signals(-status).name}", False
        return f"exit code {status}", False

    def _lost(self, rank: int, why: str) -> str | None:
        """A rank lost: replaced, or left out while the run goes on (None); else the failure."""
        role = self.plan.role(rank)
        if not self.plan.is_elastic_rank(rank):
            return f"rank {rank} ({role}) failed: {why}"
        if self._finished_at() is not None:
            return None  # lost after the run's end: nothing to replace
        setting = "rollout_restarts" if rank in self.plan.rollouts else "trainer_restarts"
        limit = int(getattr(self.job.launcher, setting))
        if self.replaced.get(rank, 0) >= limit:
            self.log.warning("rank %d (%s) lost: %s; the run goes on without it "
                             "(launcher.%s=%d)", rank, role, why, setting, limit)
            return None
        self.replaced[rank] = self.replaced.get(rank, 0) + 1
        self.log.warning("rank %d (%s) lost: %s; starting a new actor for it (%d of "
                         "launcher.%s=%d)", rank, role, why, self.replaced[rank], setting, limit)
        ray_cluster.kill_actor(self.actors[rank])
        self.actors[rank] = self._new_actor(rank)
        self.pending[self._start(rank)] = rank
        return None

    def _on_stop(self, signum: int, _frame: Any) -> None:
        if self.signalled is None:  # the first one decides; a repeat must not cut the stop short
            self.signalled = signum

    def _on_dump(self, signum: int, _frame: Any) -> None:
        """``kill -USR1 <driver>``: every rank writes its stacks and collectives to its log."""
        for actor in self._live_actors():
            actor.signal.remote(signum)
        self.log.warning("SIGUSR1: the ranks write their Python stacks and collectives to %s",
                         self.run_dir / "logs")

    def _take_signal(self) -> None:
        """A stop signal came: every rank gets it and ``launcher.shutdown_timeout`` to stop (at
        an update, with a checkpoint), then the rest are killed."""
        if self.signalled is None:
            return
        self._stop_all(self.signalled)
        name = signal.Signals(self.signalled).name
        raise LaunchInterruptedError(f"interrupted by {name}: stopped all "
                                     f"{self.plan.world_size} ranks (logs: "
                                     f"{self.run_dir / 'logs'})", self.signalled)

    def _stop_all(self, signum: int) -> None:
        import ray

        for actor in self._live_actors():
            actor.signal.remote(signum)
        self.growth.signal(signum)
        if self.pending:
            ray.wait(list(self.pending), num_returns=len(self.pending),
                     timeout=float(self.job.launcher.shutdown_timeout))
        self._kill_all()

    def _live_actors(self) -> list[Any]:
        return [self.actors[rank] for rank in set(self.pending.values())]

    def _kill_all(self) -> None:
        for actor in self.actors.values():
            ray_cluster.kill_actor(actor)
        self.actors, self.pending = {}, {}
        self.growth.kill_all()

    def _write_placement(self) -> None:
        """``placement.json``: each rank's role, Ray node id, IP and bundle, as Ray placed it."""
        placed = {str(rank): {"role": self.plan.role(rank), **self.where[rank],
                              "bundle": list(self.placement.bundle_of[rank]),
                              "placement_group": self.placement.group_id(rank),
                              "actor": self._name(rank)}
                  for rank in sorted(self.where)}
        path = self.run_dir / PLACEMENT_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"attempt": self.attempt, "ranks": placed}, indent=2))
        tmp.replace(path)


def _runtime_env() -> dict[str, Any] | None:
    """The actors import the app from where the driver does. Where a fresh interpreter finds it
    already (an installed package), nothing is added: Ray's ready workers serve the actors.
    Otherwise (a source checkout, run from its root) its path goes to them as ``PYTHONPATH``,
    which costs a worker of their own (about a second). On a cluster of other hosts the package
    must be there too (docs/clusters.md)."""
    import app

    found = subprocess.run([sys.executable, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('app') is None)"],
                           cwd="/", capture_output=True, check=False, timeout=60)
    if found.returncode == 0:
        return None
    here = str(Path(app.__file__).resolve().parents[1])
    path = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"env_vars": {"PYTHONPATH": path}}

