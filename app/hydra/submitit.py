"""Hydra's submitit launcher plugins: ``hydra/launcher=rlcomm_slurm`` submits each sweep job to
SLURM, ``rlcomm_local`` to submitit's local executor; each task then runs one rank
(app/launch/slurm.py: ``SubmititLauncher``).

They build on hydra-submitit-launcher's ``submitit_slurm`` and ``submitit_local``
(conf/hydra/launcher/); Hydra finds them as ``hydra_plugins.rlcomm_launcher.RlcommSlurmLauncher``
and ``RlcommLocalLauncher`` (Hydra's rule for launchers). What they add:

- **Shape per job.** ``nodes``, ``tasks_per_node`` and ``mem_gb`` are read from each sweep job's
  own config, so they follow that job's layout; jobs of one shape go into one job array. The plugin
  takes them once from the sweep's primary config, where a swept ``layout=`` is not applied.
- **A failed rank fails its job, promptly.** A task whose job function failed raises (the plugin
  would return the failure as a value and exit 0), so srun's ``--kill-on-bad-exit=1`` (set in the
  preset) stops the other ranks instead of leaving them blocked in a collective until
  ``comm.timeout``. The launcher waits for every job (a failed job hides none of the others) and
  turns a failed one into one error that names the failing ranks, their errors and their logs,
  instead of waiting 15 s for rank 0's missing result and reporting "task 0 has not produced any
  output". Failed jobs are recorded in the sweep's ``summary.json`` too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf, open_dict

from app.errors import JobFailedError, RankFailedError
from app.hydra import PLUGIN_MODULE
from app.hydra.sweep_jobs import refuse_bad_jobs
from app.launch.failures import read_records
from app.sweep.summary import record_job
from rlcomm.net.env import RANK_VARIABLES

log = logging.getLogger(__name__)

_SHAPE_KEYS = ("nodes", "tasks_per_node", "mem_gb")


# --------------------------------------------------------------------------------------------
# Config: resolvers and the launcher schema
# --------------------------------------------------------------------------------------------

def ranks_per_node(world_size: Any, per_node: Any = None) -> int:
    """``layout.ranks_per_node``, or the whole world on one node when it is null. Lenient: a bad
    layout still gets a job, whose ranks then report the config error."""
    world = _positive(world_size)
    return min(_positive(per_node), world) if per_node is not None else world


def node_count(world_size: Any, per_node: Any = None) -> int:
    return math.ceil(_positive(world_size) / ranks_per_node(world_size, per_node))


def multiply(*factors: Any) -> int:
    return math.prod(int(f) for f in factors)


def _positive(value: Any) -> int:
    try:
        return max(1, int(value))
    except (TypeError, ValueError):
        return 1


@dataclass
class RlcommSlurmQueueConf(SlurmQueueConf):
    """The plugin's ``submitit_slurm`` schema plus submitit's ``srun_args`` (the plugin's 1.2
    schema lacks it)."""

    _target_: str = f"{PLUGIN_MODULE}.RlcommSlurmLauncher"
    srun_args: list[str] | None = None


def register_launcher_configs() -> None:
    """Resolvers for conf/hydra/launcher/rlcomm_*.yaml, and the slurm launcher schema."""
    OmegaConf.register_new_resolver("rlcomm_ranks_per_node", ranks_per_node, replace=True)
    OmegaConf.register_new_resolver("rlcomm_nodes", node_count, replace=True)
    OmegaConf.register_new_resolver("rlcomm_mul", multiply, replace=True)
    ConfigStore.instance().store(
        group="hydra/launcher", name="rlcomm_slurm_schema", node=RlcommSlurmQueueConf,
        provider="rlcomm",
    )


# Tasks import this module when they unpickle the launcher: their sweep configs resolve too.
register_launcher_configs()



# --------------------------------------------------------------------------------------------
# Submitting: Hydra's launcher plugins
# --------------------------------------------------------------------------------------------


class RlcommLauncher(BaseSubmititLauncher):
    """Base of :class:`RlcommSlurmLauncher` and :class:`RlcommLocalLauncher`."""

    results_grace_s = 10.0  # a finished job's result files may show up late on a network FS

    @property
    def cancel_after_s(self) -> float:
        """A rank failed and its job still runs this long after: cancel the job. The local
        executor has no --kill-on-bad-exit; on SLURM this only acts when srun_args lack it."""
        return 3.0 if self._EXECUTOR == "local" else 30.0

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
    ) -> JobReturn:
        """In each task: run the Hydra job; a failure exits this task non-zero."""
        ret = super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        if ret.status == JobStatus.FAILED:
            from app.launch.environment import resolve_rank_env  # in the task, where it runs

            env = resolve_rank_env()
            err = ret._return_value
            raise RankFailedError(
                f"rank {env.rank} of {env.world_size} failed: "
                f"{type(err).__name__}: {err}"
            ) from err
        return ret

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        """The plugin's ``launch`` (which builds one executor for the whole sweep and waits for
        results it raises on), with one executor per job shape and failures of our own. The
        plugin offers no hook for either, so its body is mirrored here and pinned in
        tests/unit/test_private_apis.py: a plugin release that changes it fails there."""
        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")

        # Every job validated before the first is submitted: a bad one ends the sweep, exit 2.
        refuse_bad_jobs(self.hydra_context, self.config, job_overrides, initial_job_idx,
                        ranks_here=self._EXECUTOR == "local")
        planned = []  # (job num, overrides, shape)
        job_dirs: dict[int, Path | None] = {}
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            shape, job_dirs[num] = self._job_shape(num, overrides)
            tasks = f"{shape['nodes']} node(s) x {shape['tasks_per_node']} task(s)"
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}  [{tasks}]")
            planned.append((num, list(overrides), shape))

        jobs: list[Any] = [None] * len(planned)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for pos, (_, _, shape) in enumerate(planned):
            groups.setdefault(tuple(shape.values()), []).append(pos)
        # Rank variables of the submitting shell must not leak into the jobs (sbatch and the local
        # controller copy the environment): an inherited MASTER_PORT would give every job of an
        # array the same rendezvous port. Other launcher variables (SLURM_*) pass, as sbatch wants.
        with _without_env(RANK_VARIABLES):
            for positions in groups.values():
                executor = self._executor(planned[positions[0]][2])
                args = [
                    (planned[p][1], "hydra.sweep.dir", planned[p][0], f"job_id_for_{planned[p][0]}",
                     Singleton.get_state())
                    for p in positions
                ]
                for pos, job in zip(positions, executor.map_array(self, *zip(*args))):
                    jobs[pos] = job
        return [
            self._job_return(job, num, overrides, sweep_dir, job_dirs[num])
            for job, (num, overrides, _) in zip(jobs, planned)
        ]

    # ---- submission -----------------------------------------------------------------------

    def _job_shape(
        self, num: int, overrides: Sequence[str]
    ) -> tuple[dict[str, Any], Path | None]:
        """nodes / tasks_per_node / mem_gb as this job's own config resolves them, and the job's
        output folder (None when it cannot be known before the job runs)."""
        assert self.config is not None and self.hydra_context is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        launcher = cfg.hydra.launcher
        shape = {key: launcher.get(key, self.params.get(key)) for key in _SHAPE_KEYS}
        try:
            with open_dict(cfg.hydra.job):
                cfg.hydra.job.num = num
            job_dir: Path | None = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        except Exception:  # e.g. a subdir named after ${hydra.job.id}, known in the job only
            job_dir = None
        return shape, job_dir

    def _executor(self, shape: dict[str, Any]) -> Any:
        import submitit

        params = {**self.params, **shape}
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()}
        )
        return executor

    # ---- results --------------------------------------------------------------------------

    def _job_return(
        self, job: Any, num: int, overrides: list[str], sweep_dir: Path, job_dir: Path | None
    ) -> JobReturn:
        tasks = [job.task(i) for i in range(job.num_tasks)]
        self._wait(job, tasks)
        deadline = time.monotonic() + self.results_grace_s
        while not all(t.paths.result_pickle.exists() for t in tasks) and time.monotonic() < deadline:
            if _any_error(tasks):
                break  # a rank failed: the missing ones were stopped, they will not report
            time.sleep(0.5)
        outcomes = {i: _outcome(t) for i, t in enumerate(tasks) if t.paths.result_pickle.exists()}
        if len(outcomes) == len(tasks) and all(o[0] == "success" for o in outcomes.values()):
            ret: JobReturn = outcomes[0][1]
            return ret

        error = JobFailedError(
            self._failure_message(job, num, overrides, tasks, outcomes, job_dir)
        )
        record_job(sweep_dir, {
            "job": num,
            "overrides": filter_overrides(overrides),
            "status": "failed",
            "result": None,
            "error": str(error),
        })
        return JobReturn(
            overrides=overrides, status=JobStatus.FAILED, _return_value=error,
            working_dir=str(job_dir) if job_dir else None,
        )

    def _wait(self, job: Any, tasks: list[Any]) -> None:
        """Until every rank reported or the job ended. Polls the scheduler every 2-15 s (submitit's
        own waiting polls sacct less and less often, down to once every 10 minutes)."""
        start = time.monotonic()
        last_poll = -math.inf
        failed_at: float | None = None
        while not all(t.paths.result_pickle.exists() for t in tasks):
            now = time.monotonic()
            if now - last_poll >= min(15.0, max(2.0, (now - start) / 4)):
                last_poll = now
                if self._ended(job):
                    return
            if failed_at is None and _any_error(tasks):
                failed_at = now
            elif failed_at is not None and now - failed_at > self.cancel_after_s:
                log.warning(f"job {job.job_id}: a rank failed {self.cancel_after_s:.0f} s ago "
                            "and the others still run: cancelling the job")
                job.cancel(check=False)
                failed_at = math.inf
            time.sleep(0.5)

    def _ended(self, job: Any) -> bool:
        if self._EXECUTOR == "local":
            return bool(job.done())  # the local job's controller process has exited
        return bool(job.watcher.is_done(job.job_id, mode="force"))

    def _failure_message(
        self, job: Any, num: int, overrides: list[str], tasks: list[Any],
        outcomes: dict[int, tuple[str, Any, float]], job_dir: Path | None,
    ) -> str:
        what = " ".join(filter_overrides(overrides)) or "(no overrides)"
        head = f"sweep job #{num} ({what}) failed ({self._EXECUTOR} job {job.job_id})"
        errors = sorted((o[2], i, o[1]) for i, o in outcomes.items() if o[0] == "error")
        # Each failed rank's own record says what failed; a traceback's last line where none
        # could be written (or the job's folder is known only inside the job).
        records = read_records(job_dir / "logs") if job_dir is not None else {}
        by_message: dict[str, list[int]] = {}  # in order of failure; equal errors together
        for _, rank, trace in errors:
            record = records.get(rank)
            message = record.summary if record else _last_line(str(trace))
            message = message.replace(f" (rank {rank})", "").replace("\n", "\n    ")
            by_message.setdefault(message, []).append(rank)
        lines = [head]
        for n, (message, ranks) in enumerate(by_message.items()):
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {sorted(ranks)}"
            first = " (first to fail)" if n == 0 and len(by_message) > 1 else ""
            lines.append(f"  {who}{first}: {message}")
        silent = [i for i in range(len(tasks)) if i not in outcomes]
        if silent:
            who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {silent}"
            lines.append(f"  {who} ended without reporting (stopped or killed; job state {job.state})")
        if not errors:
            lines += [f"  {line}" for line in _scheduler_lines(tasks[0].paths.stderr)]
        failing = [e[1] for e in errors] or silent
        if failing:
            rank = failing[0]
            logs = [str(tasks[rank].paths.stderr)]
            if job_dir is not None and (job_dir / "logs" / f"rank{rank}.log").exists():
                logs.insert(0, str(job_dir / "logs" / f"rank{rank}.log"))
            lines.append(f"  logs of rank {rank}: {', '.join(logs)}")
        return "\n".join(lines)


def _outcome(task: Any) -> tuple[str, Any, float]:
    """(``success``/``error``, value or traceback, mtime) from a task's result file."""
    from submitit.core.utils import pickle_load

    path = task.paths.result_pickle
    try:
        outcome, value = pickle_load(path)
        return str(outcome), value, path.stat().st_mtime
    except Exception:  # unreadable (submitit writes it atomically, so rather a broken file)
        return "pending", None, math.inf


def _any_error(tasks: list[Any]) -> bool:
    return any(_outcome(t)[0] == "error" for t in tasks if t.paths.result_pickle.exists())


def _last_line(trace: str) -> str:
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no traceback)"


def _scheduler_lines(path: Path, limit: int = 5) -> list[str]:
    """What srun/slurmstepd said about the step (they write into task 0's stderr)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    said = [ln for ln in text.splitlines() if ln.startswith(("srun:", "slurmstepd"))]
    return said[-limit:]


@contextlib.contextmanager
def _without_env(names: Sequence[str]) -> Iterator[None]:
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


# Hydra registers a launcher under its class's ``__module__`` and instantiates only those under
# ``hydra_plugins``: these name the module that re-exports them, where a task's pickle finds
# them too (importing it registers the resolvers above).


class RlcommSlurmLauncher(RlcommLauncher):
    """``hydra/launcher=rlcomm_slurm``: each sweep job a SLURM job (array)."""

    __module__ = PLUGIN_MODULE
    _EXECUTOR = "slurm"


class RlcommLocalLauncher(RlcommLauncher):
    """``hydra/launcher=rlcomm_local``: each sweep job a job of submitit's local executor."""

    __module__ = PLUGIN_MODULE
    _EXECUTOR = "local"
