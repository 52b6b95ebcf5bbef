"""``python -m app.join RUN_DIR role=rollout``: one more rollout rank for the job running in
RUN_DIR, beyond its plan (docs/growth.md).

It runs on any host that reaches the job's rendezvous store (``job.json`` in the run dir says
where), takes the job's own composed config (``.hydra/config.yaml``; only ``loop.threads`` may
differ here), gets a rank number the job never had, asks the trainer that leads the fewest
rollout ranks to admit it, and runs until the job ends: its trainer admits it at an update
boundary, sends it the current weights and normaliser statistics (verified by checksum), and
trains on its segments. Bad input is one line, exit 2, and the running job is untouched.
"""

from __future__ import annotations

import os

# c10d logs a store it cannot reach on stderr, frames and all: the one line below says it.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from app.api import ConfigError, RankEnv, RunShape
from app.errors import say_error
from app.launch.jobfile import (
    FINISHED,
    JobRecord,
    JobUnreachable,
    config_digest,
    connect_job,
    live_trainers,
    package_version,
    read_job_record,
)
from app.launch.lifeline import die_with_parent
from app.launch.planning import ValidatedJob, validate_job
from app.output.trackers.fanout import RUN_CONFIG
from rlcomm import LayoutPlan
from rlcomm.elastic import Keys, epoch_members, latest_epoch, new_rank, new_ranks

USAGE = "usage: python -m app.join RUN_DIR role=rollout|trainer|replica [loop.threads=N]"
ROLES = ("rollout", "trainer", "replica")
MAY_DIFFER = ("loop.threads",)  # a host's own choice; everything else is the job's
# What a replica group's command tells each process it starts: the group's ranks, and its own.
REPLICA_RANKS, REPLICA_RANK = "RLCOMM_REPLICA_RANKS", "RLCOMM_REPLICA_RANK"


@dataclass(frozen=True)
class Request:
    run_dir: Path
    role: str
    overrides: tuple[str, ...] = ()


def parse(argv: list[str]) -> Request:
    """The run dir, the role and the overrides; one line (ValueError) where they are wrong."""
    if len(argv) < 2 or not argv[1].startswith("role="):
        raise ValueError(USAGE)
    role = argv[1].removeprefix("role=")
    if role not in ROLES:
        raise ValueError(f"role={role}: one of {', '.join(ROLES)}")
    for override in argv[2:]:
        key = override.split("=", 1)[0].lstrip("+~")
        if key not in MAY_DIFFER:
            raise ValueError(f"{override}: a joiner runs the job's own config "
                             f"({RUN_CONFIG}); only {', '.join(MAY_DIFFER)} may differ")
    return Request(Path(argv[0]), role, tuple(argv[2:]))


def check_role(record: JobRecord, role: str) -> None:
    """What the job can take; one line where it cannot."""
    if role == "rollout":
        if not record.shape.elastic_rollouts:
            raise JobUnreachable("role=rollout: this job's rollout ranks are not elastic "
                                 "(layout.elastic_rollouts=false): none can join while it runs")
        return
    if not record.shape.elastic_trainers:
        raise JobUnreachable(f"role={role}: this job's trainers are not elastic "
                             "(layout.elastic_trainers=false): none can join while it runs")
    grouped = record.shape.replica_groups
    if role == "trainer" and grouped:
        raise JobUnreachable("role=trainer: this job's trainers are sharded in replica groups: "
                             "they grow by a whole replica group (role=replica)")
    if role == "trainer" and record.shape.sharded:
        raise JobUnreachable("role=trainer: this job's trainers are sharded in one grid; one "
                             "more trainer joins plain data-parallel trainers only")
    if role == "replica" and not grouped:
        raise JobUnreachable("role=replica: this job's trainers form no replica groups "
                             "(layout.trainer_replicas=1): one more trainer joins with "
                             "role=trainer")


def check_same_job(run_dir: Path, record: JobRecord) -> None:
    """The joiner runs the job's package and config; one line where it would not."""
    mine = package_version()
    if record.version != mine:
        raise JobUnreachable(f"this is rlcomm {mine}, and the job runs rlcomm {record.version}: "
                             "a joiner must run the job's version")
    now = config_digest(run_dir)
    if record.config_digest and now != record.config_digest:
        raise JobUnreachable(f"{run_dir / RUN_CONFIG} changed since the job started (digest "
                             f"{now}, the job's {record.config_digest}): a joiner would run "
                             "another config")


def job_config(request: Request) -> tuple[LayoutPlan, ValidatedJob]:
    """The job's plan and config, as it validated them, with this host's overrides."""
    cfg = OmegaConf.load(request.run_dir / RUN_CONFIG)
    for override in request.overrides:
        key, value = override.lstrip("+~").split("=", 1)
        OmegaConf.update(cfg, key, value, force_add=True)  # the schema types it (validate_job)
    # Probed here: the job's rank 0 shares its spaces only with ranks that validated themselves.
    return validate_job(cfg)  # type: ignore[arg-type]  # the run's own config


def least_led(store: Any, trainers: list[int], rank: int) -> int:
    """The trainer that leads the fewest rollout ranks now; on a tie, the one ``rank`` falls to
    round robin, so joiners started together (each reads the counts before either is
    admitted) spread over the tied trainers."""
    def led(trainer: int) -> int:
        return len(epoch_members(store, trainer, latest_epoch(store, trainer)))

    def turn(trainer: int) -> int:
        return (trainers.index(trainer) - rank) % len(trainers)

    return min(trainers, key=lambda trainer: (led(trainer), turn(trainer)))


def grown_plan(plan: LayoutPlan, trainers: list[int], shape: RunShape) -> LayoutPlan:
    """``plan`` with the live trainers that joined beyond it (with replica groups: theirs)."""
    extra = sorted(t for t in trainers if t not in plan.trainers)
    if shape.replica_groups:
        size = len(plan.replicas[0])
        for i in range(0, len(extra), size):
            plan = plan.with_replica_group(extra[i : i + size])
        return plan
    for trainer in extra:
        plan = plan.with_trainer_rank(trainer)
    return plan


def join(request: Request) -> None:
    """Runs one rank beyond the job's plan until the job ends (a replica group: one process per
    rank, started here, :func:`start_replica_group`)."""
    record = read_job_record(request.run_dir)
    check_role(record, request.role)
    check_same_job(request.run_dir, record)
    store = connect_job(request.run_dir, record)
    plan, job = job_config(request)
    trainers = live_trainers(store, record)
    plan = grown_plan(plan, trainers, record.shape)
    local = 1
    if request.role == "replica":
        if REPLICA_RANKS not in os.environ:  # the command itself: it starts the group
            start_replica_group(request, store, record, len(plan.replicas[0]), trainers[0])
            return
        ranks = [int(r) for r in os.environ[REPLICA_RANKS].split(",")]
        rank, local = int(os.environ[REPLICA_RANK]), len(ranks)
        plan, asks = plan.with_replica_group(ranks), trainers[0]
    elif request.role == "trainer":
        rank = new_rank(store, record.world_size)
        plan, asks = plan.with_trainer_rank(rank), trainers[0]
    else:
        rank = new_rank(store, record.world_size)
        asks = least_led(store, trainers, rank)
        plan = plan.with_rollout_rank(rank, asks)
    env = RankEnv("join", rank=rank, world_size=record.world_size, local_world_size=local,
                  node=socket.gethostname(), master_addr=record.store.host,
                  master_port=record.store.port)
    print(f"rank {rank} ({request.role}, beyond the plan of {record.world_size}) asks rank "
          f"{asks} to admit it", file=sys.stderr, flush=True)
    from app.launch.rank import run_beyond_plan  # torch and the runtime: once the checks passed

    run_beyond_plan(job, plan, request.run_dir, store, env)


def start_replica_group(request: Request, store: Any, record: JobRecord, size: int,
                        lead: int) -> None:
    """A replica group beyond the plan: ``size`` consecutive new ranks, announced to the lead,
    each run by a process of its own (this command again, told its rank), all waited for; the
    first to fail ends the others."""
    from app.runtime.membership.replicas import announce_replica
    from app.runtime.membership.trainers import SPACE

    ranks = new_ranks(store, record.world_size, size)
    announce_replica(store, Keys(lead, SPACE), ranks)
    print(f"ranks {ranks} (a replica group, beyond the plan of {record.world_size}) ask rank "
          f"{lead} to admit them", file=sys.stderr, flush=True)
    argv = [sys.executable, "-m", "app.join", str(request.run_dir), "role=replica",
            *request.overrides]
    procs = {rank: subprocess.Popen(argv, env={**os.environ, REPLICA_RANKS: ",".join(map(str, ranks)),
                                               REPLICA_RANK: str(rank)},
                                    preexec_fn=die_with_parent)
             for rank in ranks}
    failed = None
    while procs and failed is None:
        for rank, proc in list(procs.items()):
            if proc.poll() is not None:
                del procs[rank]
                failed = rank if proc.returncode else None
        time.sleep(0.2)
    for proc in procs.values():  # the group cannot go on without a rank
        proc.kill()
        proc.wait()
    if failed is not None:
        raise RuntimeError(f"rank {failed} of the replica group {ranks} failed; the group ended")


def failure_line(run_dir: Path, err: BaseException) -> str:
    """What a joiner that failed says: a job that finished meanwhile took its store with it
    (a joiner admitted in time ends with the job, exit 0); else the rank's own failure (its log
    has the traceback)."""
    if (run_dir / FINISHED).exists():
        return (f"{run_dir}: the job ended ({FINISHED}) while this joiner was joining it "
                f"({type(err).__name__}: {err})")
    return f"the joiner failed: {type(err).__name__}: {err}"


def main(argv: list[str] | None = None) -> int:
    request: Request | None = None
    try:
        request = parse(sys.argv[1:] if argv is None else argv)
        join(request)
    except (ValueError, ConfigError) as err:  # JobUnreachable is a ConfigError
        say_error(str(err))
        return 2
    except Exception as err:  # the rank failed, or the job ended first
        if request is None:  # not a joiner's failure: parse itself broke
            raise
        say_error(failure_line(request.run_dir, err))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
