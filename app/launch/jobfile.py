"""``<run dir>/job.json``: how a process outside a running job reaches it (``python -m app.leave``,
``python -m app.join``).

Rank 0 writes it once the planned groups exist and the job admits joiners
(``rlcomm.elastic.mark_running``): where the rendezvous store is and the prefix its keys live
under, who the planned trainers and rollout ranks are, and the timeout every wait on the job
takes. A restarted attempt writes it again (a new store). The side commands read it, check that
the job still runs (no ``result.json``; its store answers and says it runs) and refuse in one
line, exit 2, otherwise (:class:`JobUnreachable`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from torch import distributed as dist

from app.api import RunShape
from app.errors import ConfigError
from app.output.trackers.fanout import RUN_CONFIG
from rlcomm.elastic import epoch_members, is_running, latest_epoch
from rlcomm.net.rendezvous import StoreLocation, connect_store, store_location
from rlcomm.plan.layout import LayoutPlan

JOB_FILE = "job.json"
FINISHED = "result.json"  # rank 0 writes it last (app/launch/rundir.py's FINISHED)


class JobUnreachable(ConfigError):
    """A side command cannot reach a running job in the run dir it was given: one line."""


@dataclass(frozen=True)
class JobRecord:
    """What ``job.json`` holds."""

    store: StoreLocation
    world_size: int
    trainers: list[int]
    rollouts: list[int]
    shape: RunShape  # what may join and leave (its elastic_* flags)
    timeout_s: float
    pid: int  # rank 0's
    host: str  # rank 0's
    version: str  # the package's, which a joiner must run too
    config_digest: str  # of the run's composed config as the job started (.hydra/config.yaml)


def write_job_record(run_dir: Path, plan: LayoutPlan, shape: RunShape, timeout_s: float) -> None:
    """Rank 0, once the job admits joiners; nothing where its store is not a TCP store (a
    ``file://`` rendezvous: no process outside the job can reach it)."""
    location = store_location()
    if location is None:
        return
    record = JobRecord(location, plan.world_size, list(plan.trainers), list(plan.rollouts),
                       shape, timeout_s, os.getpid(), socket.gethostname(), package_version(),
                       config_digest(run_dir))
    path = run_dir / JOB_FILE
    fresh = path.with_name(f".{JOB_FILE}.{os.getpid()}")
    fresh.write_text(json.dumps(asdict(record), indent=2))
    fresh.replace(path)  # whole or not at all: a reader never sees half of it


def package_version() -> str:
    try:
        return version("rlcomm")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def config_digest(run_dir: Path) -> str:
    """A digest of the run's composed config (empty where there is none)."""
    path = run_dir / RUN_CONFIG
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else ""


def read_job_record(run_dir: Path) -> JobRecord:
    """The running job's record; one line (:class:`JobUnreachable`) where there is none."""
    if not run_dir.is_dir():
        raise JobUnreachable(f"{run_dir}: no such run dir")
    if (run_dir / FINISHED).exists():
        raise JobUnreachable(f"{run_dir}: the run finished ({FINISHED}); nothing runs there")
    try:
        data = json.loads((run_dir / JOB_FILE).read_text())
        return JobRecord(**{**data, "store": StoreLocation(**data["store"]),
                            "shape": RunShape(**data["shape"])})
    except FileNotFoundError:
        raise JobUnreachable(
            f"{run_dir}: no running job there ({JOB_FILE} is written once a job with elastic "
            "ranks runs)") from None
    except (ValueError, TypeError, KeyError) as err:
        raise JobUnreachable(f"{run_dir / JOB_FILE}: unreadable ({err})") from None


def reach_job(run_dir: Path) -> tuple[JobRecord, dist.Store]:
    """The running job's record and its store; one line where it cannot be reached."""
    record = read_job_record(run_dir)
    return record, connect_job(run_dir, record)


def connect_job(run_dir: Path, record: JobRecord) -> dist.Store:
    """The job's store, once it answers and says the job runs; one line where it does not
    within the job's ``comm.timeout``."""
    wait = record.timeout_s
    where = f"{record.store.host}:{record.store.port}"
    try:
        store = connect_store(record.store, datetime.timedelta(seconds=wait))
        running = is_running(store)
    except (RuntimeError, dist.DistError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise JobUnreachable(
            f"{run_dir}: the job's store at {where} did not answer within {wait:g} s: the job "
            f"has ended or this host cannot reach it ({reason})") from None
    if not running:
        raise JobUnreachable(f"{run_dir}: the job at {where} does not admit joiners yet")
    return store


def live_trainers(store: dist.Store, record: JobRecord) -> list[int]:
    """The job's trainers now, the lead first: with elastic trainers, the lead's latest epoch
    of them (trainers beyond the plan included, those let go or lost left out); else the
    planned ones."""
    if not record.shape.elastic_trainers:
        return list(record.trainers)
    from app.runtime.membership.trainers import SPACE  # the trainers' series (the RL runtime's)

    lead = record.trainers[0]
    return epoch_members(store, lead, latest_epoch(store, lead, SPACE), SPACE)
