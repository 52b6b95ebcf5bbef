"""Hydra callback: a sweep summary that lists every job, failed ones included, and ranks them.

Per job (``on_job_end``, in the job's rank-0 process): its entry in ``summary.json``. After the
sweep (``on_multirun_end``, in the process that ran the sweep, for the basic and the submitit
launchers alike): every job's metrics in ``summary.json``, the ranked table in ``summary.md`` and
on stdout, and ``sweep.png``. Hydra skips ``on_multirun_end`` when a job failed (the sweeper
raises the job's error first), so the same report is also written at exit in that case.

It lives with the other Hydra adapters, above both rooms it joins: it asks the launch room which
rank this process is (app/launch/environment.py); what it writes is app/sweep/'s.
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from app.errors import ConfigError
from app.launch.environment import resolve_rank_env
from app.metrics import check_metric_name, declared_metrics
from app.sweep.summary import record_job, write_sweep_report


class SweepSummary(Callback):
    """After each sweep job, records its overrides, status and result in
    ``<sweep dir>/summary.json`` (written per job, so a failing job hides nothing); after the
    sweep, ranks the jobs (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: tuple[Path, str | None, str | None] | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        rank_by = OmegaConf.select(config, "sweep.rank_by")
        loop = OmegaConf.select(config, "loop._target_")
        # Against the configured loop's metrics and the app's; a loop that cannot be imported
        # is left to each job's own validation, which names the real problem.
        try:
            if rank_by is not None and declared_metrics(loop) is not None:
                check_metric_name(str(rank_by), loop)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)  # before any job starts
            sys.exit(2)
        self._pending = (Path(str(config.hydra.sweep.dir)), rank_by, loop)
        atexit.register(self._report)  # runs when a failed job ended the sweep early

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._report()

    def _report(self) -> None:
        if self._pending is None:
            return
        sweep_dir, rank_by, loop = self._pending
        self._pending = None
        try:
            table = write_sweep_report(sweep_dir, rank_by, loop)
        except ConfigError as err:  # no job's loop declares the metric (e.g. not importable here)
            print(f"error: sweep report: {err}", file=sys.stderr)
            return
        if table is not None:
            print(f"\nsweep summary: {sweep_dir / 'summary.md'}\n{table}", flush=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN or resolve_rank_env().rank != 0:
            return
        job_dir = Path(hydra_cfg.runtime.output_dir)
        ok = job_return.status == JobStatus.COMPLETED
        record_job(Path(config.hydra.sweep.dir), {
            "job": hydra_cfg.job.num,
            "overrides": list(hydra_cfg.overrides.task),
            "status": "ok" if ok else "failed",
            "result": str(job_dir / "result.json") if ok else None,
            "error": None if ok else str(job_return._return_value),
        })
