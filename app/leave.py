"""``python -m app.leave RUN_DIR rank=N``: asks rank N of the job running in RUN_DIR, a rollout
rank or an elastic trainer other than the lead, to leave at the next update boundary, as a
SIGTERM to that rank alone does; the others go on, and the leave is recorded with reason
``asked`` (docs/growth.md). It waits until the rank's leader (its trainer; for a trainer, the
lead trainer) let it go, up to the job's ``comm.timeout``. Bad input is one line, exit 2."""

from __future__ import annotations

import os

# c10d logs a store it cannot reach on stderr, frames and all: the one line below says it.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import sys
import time
from pathlib import Path

from app.errors import say_error
from app.launch.jobfile import JobRecord, JobUnreachable, live_trainers, reach_job
from rlcomm.elastic import ask_to_leave, let_go_epoch

USAGE = "usage: python -m app.leave RUN_DIR rank=N"


def parse(argv: list[str]) -> tuple[Path, int]:
    """The run dir and the rank; one line (ValueError) where they are not given right."""
    if len(argv) != 2 or not argv[1].startswith("rank="):
        raise ValueError(USAGE)
    value = argv[1].removeprefix("rank=")
    if not value.isdigit():
        raise ValueError(f"rank={value}: a rank number (an integer >= 0)")
    return Path(argv[0]), int(value)


def leave(run_dir: Path, rank: int) -> str:
    """Asks ``rank`` to leave and waits for its leader to let it go; what happened, in a line."""
    job, store = reach_job(run_dir)
    leader = check_may_leave(job, rank, live_trainers(store, job))
    before = let_go_epoch(store, rank)
    ask_to_leave(store, rank, "asked")
    deadline = time.monotonic() + job.timeout_s
    while time.monotonic() < deadline:
        epoch = let_go_epoch(store, rank)
        if epoch is not None and epoch != before:
            return f"rank {rank} left the job: {leader} let it go from epoch {epoch}"
        time.sleep(0.1)
    raise TimeoutError(f"rank {rank} was not let go within comm.timeout={job.timeout_s:g} s: "
                       "it is not a live rank of the job that may leave, or the job is stopping")


def check_may_leave(job: JobRecord, rank: int, trainers: list[int]) -> str:
    """Who lets ``rank`` go (its trainer, or the lead trainer); one line where it cannot leave."""
    if rank == job.trainers[0]:
        raise JobUnreachable(f"rank={rank}: the lead trainer holds the run's records and "
                             "decisions and cannot leave; stop the run instead (SIGTERM to "
                             "python -m app)")
    if rank not in trainers and rank not in job.trainers:
        if not job.shape.elastic_rollouts:
            raise JobUnreachable(f"rank={rank}: this job's rollout ranks are not elastic "
                                 "(layout.elastic_rollouts=false): none can leave while it runs")
        return "its trainer"
    if not job.shape.elastic_trainers:
        raise JobUnreachable(f"rank={rank}: a trainer, and this job's trainers are not elastic "
                             "(layout.elastic_trainers=false): none can leave while it runs")
    if job.shape.replica_groups:
        raise JobUnreachable(f"rank={rank}: a trainer of a replica group "
                             "(layout.trainer_replicas): its shards leave only with its group")
    return "the lead trainer"


def main(argv: list[str] | None = None) -> int:
    try:
        run_dir, rank = parse(sys.argv[1:] if argv is None else argv)
        print(leave(run_dir, rank))
    except (ValueError, JobUnreachable) as err:
        say_error(str(err))
        return 2
    except TimeoutError as err:
        say_error(str(err))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
