"""Hydra callbacks: a sweep summary that lists every job, failed ones included."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from .environment import resolve_rank_env


class SweepSummary(Callback):
    """After each sweep job, records its overrides, status and result in
    ``<sweep dir>/summary.json`` (written per job, so a failing job hides nothing)."""

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


def record_job(sweep_dir: Path, entry: dict[str, Any]) -> None:
    """Adds or replaces one job's entry in ``<sweep dir>/summary.json``. Jobs of a submitit sweep
    end at once, in separate processes: a lock file serialises them."""
    path = sweep_dir / "summary.json"
    with open(sweep_dir / ".summary.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        jobs = json.loads(path.read_text())["jobs"] if path.exists() else []
        jobs = [j for j in jobs if j["job"] != entry["job"]] + [entry]
        tmp = path.with_name(f".summary.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"jobs": sorted(jobs, key=lambda j: j["job"])}, indent=2))
        os.replace(tmp, path)
