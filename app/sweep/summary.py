"""A sweep's records: every job's entry in ``<sweep dir>/summary.json``, failed ones included,
then the ranked report (``summary.md``, ``sweep.png``) written from them.

Hydra's callback that calls these in a sweep (app/hydra/sweep_summary.py) and the submitit launchers
(a job whose ranks failed, app/hydra/submitit.py) write the entries; the ranking itself is
app/sweep/report.py's.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any


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


def write_sweep_report(sweep_dir: Path, rank_by: str | None, loop: str | None) -> str | None:
    """Every job's metrics into ``summary.json``, the ranked metric into ``sweep.png`` (what it
    plots under ``plot`` in summary.json) and the ranked table into ``summary.md`` (returned);
    None when no job was recorded."""
    from app.sweep.plot import plot_sweep
    from app.sweep.report import build_report, format_table, read_jobs, report_json

    path = sweep_dir / "summary.json"
    if not path.exists():
        return None
    with open(sweep_dir / ".summary.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = json.loads(path.read_text())["jobs"]
        jobs = read_jobs(entries)
        report = build_report(jobs, rank_by, loop)
        for entry, job in zip(entries, jobs):
            entry["metrics"] = job.metrics
        plotted = plot_sweep(report, sweep_dir / "sweep.png")
        summary = {**report_json(report), "plot": asdict(plotted), "jobs": entries}
        tmp = path.with_name(f".summary.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, path)
    table = format_table(report)
    (sweep_dir / "summary.md").write_text(table)
    return table
