"""Where this process stands: launching ranks itself, or joining ranks that already exist.

Join mode is detected from the environment, in this order:

1. torchrun/torchelastic (TORCHELASTIC_RUN_ID + RANK): first, since it can run inside SLURM.
2. A task of an srun job step with more than one task (plain ``srun``, or a submitit SLURM job):
   rank SLURM_PROCID, world size SLURM_NTASKS, local rank SLURM_LOCALID. The batch script itself
   (``sbatch`` sets SLURM_PROCID=0 and SLURM_NTASKS there too, but no SLURM_STEP_ID) and a
   one-task step (``srun --pty bash``, ``srun -n1 python -m app``) are not ranks: the app launches
   the layout's ranks itself there, as on any machine.
3. A task of a multi-task submitit *local* job (SUBMITIT_LOCAL_GLOBALID, SUBMITIT_LOCAL_NTASKS).
4. RANK and WORLD_SIZE set by hand.

Otherwise the app launches ``layout.world_size`` local ranks.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Placement:
    kind: str  # "local" | "torchrun" | "slurm" | "submitit" | "env"
    rank: int = 0
    world_size: int = 1
    note: str | None = None  # something the user should know about how the app was started


# SLURM gives the batch script, the extern step, the interactive step and pending steps ids near
# 2**32 (22.05: 0xfffffffa-0xfffffffd; older releases 0xfffffffe-0xffffffff).
_FIRST_SPECIAL_STEP_ID = 0xFFFFFFF0

# MASTER_PORT derived from the job id: below Linux's ephemeral range (32768-60999), where the
# outgoing connections of gloo/NCCL take their local ports. Each job owns _STEPS_PER_JOB
# consecutive ports (one per concurrent job step), so jobs whose ids differ by less than
# _PORT_SPAN // _STEPS_PER_JOB (2000) never share a port, however they land on nodes. This matters
# for the jobs of one array, which run at once, often on one node, with consecutive SLURM_JOB_IDs.
_PORT_BASE = 15000
_PORT_SPAN = 16000
_STEPS_PER_JOB = 8


def slurm_step(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(job id, step id)`` when this process is a task of an srun job step, else None."""
    env = os.environ if env is None else env
    step, job = env.get("SLURM_STEP_ID", ""), env.get("SLURM_JOB_ID", "")
    if not (step.isdigit() and job.isdigit()) or int(step) >= _FIRST_SPECIAL_STEP_ID:
        return None
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    return int(job), int(step)


def detect_placement() -> Placement:
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
        return Placement("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]))
    if slurm_step(env) is not None:
        ntasks = int(env["SLURM_NTASKS"])
        if ntasks > 1:
            return Placement("slurm", int(env["SLURM_PROCID"]), ntasks)
        return Placement("local")  # e.g. srun --pty bash; srun -n1 python -m app
    if env.get("SUBMITIT_EXECUTOR") == "local" and "SUBMITIT_LOCAL_GLOBALID" in env:
        ntasks = int(env.get("SUBMITIT_LOCAL_NTASKS", "1"))
        if ntasks > 1:
            return Placement("submitit", int(env["SUBMITIT_LOCAL_GLOBALID"]), ntasks)
    if "RANK" in env and "WORLD_SIZE" in env:
        return Placement("env", int(env["RANK"]), int(env["WORLD_SIZE"]))
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return Placement(
            "local",
            note=(
                f"inside SLURM job {env['SLURM_JOB_ID']} ({env['SLURM_NTASKS']} tasks) but not in "
                "an srun job step: launching every rank on this node; run "
                "`srun python -m app ...` to make each SLURM task one rank"
            ),
        )
    return Placement("local")


def distributed_env(placement: Placement, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for a SLURM or
    submitit-local task (empty for the other placements, which have them already).

    MASTER_ADDR is the first host of the step (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST),
    where rank 0 runs; MASTER_PORT is kept when set, else derived from the job and step ids
    (see ``master_port``). Unlike ``submitit.helpers.TorchDistributedEnvironment``, this works in
    plain srun steps too (submitit's needs SUBMITIT_EXECUTOR) and never gives two jobs of one
    array the same port (submitit's draws it at random, seeded by the job id).
    """
    env = os.environ if env is None else env
    if placement.kind == "slurm":
        job_id, step_id = slurm_step(env) or (0, 0)
        node = int(env.get("SLURM_NODEID", "0"))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
        local_world = tasks_on_node(per_node, node) or placement.world_size
        local_rank = env.get("SLURM_LOCALID", "0")
        addr = first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    elif placement.kind == "submitit":
        job_id, step_id = int(env["SUBMITIT_LOCAL_JOB_ID"]), 0
        local_world = placement.world_size
        local_rank = env.get("SUBMITIT_LOCAL_LOCALID", str(placement.rank))
        addr = "127.0.0.1"
    else:
        return {}
    return {
        "RANK": str(placement.rank),
        "WORLD_SIZE": str(placement.world_size),
        "LOCAL_RANK": local_rank,
        "LOCAL_WORLD_SIZE": str(local_world),
        "MASTER_ADDR": addr,
        "MASTER_PORT": env.get("MASTER_PORT") or str(master_port(job_id, step_id)),
    }


def export_distributed_env(placement: Placement) -> None:
    """Make RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT describe
    this process, whatever started it (local agent and torchrun set them already)."""
    os.environ.update(distributed_env(placement))


def master_port(job_id: int, step_id: int = 0) -> int:
    """A rendezvous port for one job step: distinct for jobs with nearby ids (an array's jobs) and
    for up to 8 concurrent steps of one job."""
    slot = job_id * _STEPS_PER_JOB + step_id % _STEPS_PER_JOB
    return _PORT_BASE + slot % _PORT_SPAN


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``gpu[003-004,010],cpu01`` (submitit's parser)."""
    if not nodelist:
        return socket.gethostname()
    from submitit.slurm.slurm import _parse_node_list

    return str(_parse_node_list(nodelist)[0])


def tasks_on_node(tasks_per_node: str, node: int) -> int | None:
    """Tasks on node ``node`` from SLURM's compressed list, e.g. ``2(x3),1`` -> 2, 2, 2, 1."""
    counts: list[int] = []
    try:
        for item in filter(None, tasks_per_node.split(",")):
            count, _, repeat = item.partition("(x")
            counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    except ValueError:
        return None
    return counts[node] if 0 <= node < len(counts) else None


def run_id() -> str:
    """A run directory name that every rank of one joined run computes alike.

    Each rank of a joined run is its own Hydra process and would otherwise resolve ``${now:}``
    itself and scatter the run over several folders. A SLURM job step is named like sacct names
    it: ``slurm-<job>.<step>`` (``<job>`` is ``<array job>_<index>`` in an array), so several
    ``srun`` steps of one batch script get one folder each.
    """
    env = os.environ
    if env.get("RLCOMM_RUN_ID"):
        return env["RLCOMM_RUN_ID"]
    step = slurm_step(env)
    if step is not None:
        job = str(step[0])
        if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        return f"slurm-{job}.{step[1]}"
    if "TORCHELASTIC_RUN_ID" in env:
        rdzv = env["TORCHELASTIC_RUN_ID"]
        if rdzv not in ("", "none"):
            return f"torchrun-{rdzv}"
        # Every local worker shares its agent (the parent): name the run after it.
        return f"torchrun-{os.getppid()}-{_start_ticks(os.getppid())}"
    if "RANK" in env and "MASTER_PORT" in env:
        return f"join-{env.get('MASTER_ADDR', 'local')}-{env['MASTER_PORT']}"
    from datetime import datetime

    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")


def output_subdir() -> str | None:
    """Only the first rank of a joined run writes Hydra's ``.hydra/`` folder."""
    return ".hydra" if detect_placement().rank == 0 else None


def _start_ticks(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[19]
    except (OSError, IndexError):
        return "0"
