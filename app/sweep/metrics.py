"""The figures jobs report in ``result.json["metrics"]``, and which way each one is better.

One registry, read by the sweep report (to rank jobs) and by config validation (to reject a
``sweep.rank_by`` that no job reports). Per-group commcheck figures are named
``<metric>:<group>``, e.g. ``latency_us:WEIGHT_TRANSFER[0,2]``; their direction is the base name's.
"""

from __future__ import annotations

import os
import time
from typing import Literal

from app.errors import ConfigError

Direction = Literal["min", "max"]
JOB_START_VARIABLE = "RLCOMM_JOB_START"  # time.time() when the job started; ranks inherit it
_PROCESS_START = time.time()  # roughly this process's start: the app imports this module early

DIRECTIONS: dict[str, Direction] = {
    # the app, every loop (app/launch/rank.py)
    "startup_s": "min",  # job start to the first collective (rendezvous done), rank 0
    "group_creation_s": "min",  # creating every planned group, rank 0
    "wall_s": "min",  # job start to result.json written
    # PPO (app/loops/ppo/)
    "env_steps_per_s": "max",
    "time_to_target_s": "min",  # None when the target return was not reached
    "env_steps_to_target": "min",  # None when the target return was not reached
    "reached_target": "max",  # 1 or 0
    "updates_per_s": "max",
    "transfer_s": "min",  # weight-transfer time per trainer
    "transfer_share": "min",  # weight-transfer time / trainer loop time
    "trainer_wait_fraction": "min",  # trainers blocked on rollouts' trajectories
    "rollout_wait_fraction": "min",  # rollouts blocked on trainers (weights, trajectory hand-off)
    "final_mean_return": "max",
    # commcheck (app/loops/commcheck.py); per group as "<name>:<group>" too
    "latency_us": "min",
    "bandwidth_gbps": "max",
    "max_latency_us": "min",  # the slowest group's all_reduce latency
    "min_bandwidth_gbps": "max",  # the slowest group's broadcast bandwidth
}

# What a sweep ranks by when the user does not say, per loop target; then a few more columns.
DEFAULT_RANK_BY = {
    "app.loops.ppo.PPOLoop": "time_to_target_s",
    "app.loops.commcheck.CommCheck": "max_latency_us",
}
FALLBACK_RANK_BY = "wall_s"
HEADLINE = {
    "app.loops.ppo.PPOLoop": ("time_to_target_s", "env_steps_to_target", "env_steps_per_s",
                              "transfer_share", "trainer_wait_fraction", "rollout_wait_fraction"),
    "app.loops.commcheck.CommCheck": ("max_latency_us", "min_bandwidth_gbps"),
}
FALLBACK_HEADLINE = ("wall_s", "startup_s")


def direction(name: str) -> Direction:
    """``"min"`` when lower is better, ``"max"`` when higher is; KeyError for unknown names."""
    return DIRECTIONS[name.split(":", 1)[0]]


def check_metric_name(name: str, where: str = "sweep.rank_by") -> None:
    """One-line error for a metric no job reports."""
    if name.split(":", 1)[0] not in DIRECTIONS:
        raise ConfigError(
            f"{where}: unknown metric {name!r}; known: {', '.join(sorted(DIRECTIONS))}"
        )


def default_rank_by(loop_target: str | None) -> str:
    return DEFAULT_RANK_BY.get(str(loop_target), FALLBACK_RANK_BY)


def headline(loop_target: str | None) -> tuple[str, ...]:
    return HEADLINE.get(str(loop_target), FALLBACK_HEADLINE)


def mark_job_start() -> None:
    """Called where a job starts (the app's entry point, once per sweep job)."""
    os.environ[JOB_START_VARIABLE] = repr(time.time())


def job_start_time() -> float:
    """When this job started: the mark, else this process's start (a rank started another way,
    e.g. a test calling ``run_rank`` directly)."""
    mark = os.environ.get(JOB_START_VARIABLE)
    return float(mark) if mark else _PROCESS_START
