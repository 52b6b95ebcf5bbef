"""Who this process is (:class:`RankEnv`): launching the ranks itself, or one rank of a job.

The only module that reads launcher variables. Join mode is detected in this order:

1. A rank the Ray engine started (RLCOMM_ENGINE=ray + RANK: app/launch/ray_rank.py), then
   torchrun/torchelastic (TORCHELASTIC_RUN_ID + RANK): first, since they can run inside SLURM.
2. A task of an srun job step with more than one task (plain ``srun``, or a submitit SLURM job):
   rank SLURM_PROCID, world size SLURM_NTASKS, local rank SLURM_LOCALID. The batch script itself
   (``sbatch`` sets SLURM_PROCID=0 and SLURM_NTASKS there too, but no SLURM_STEP_ID) and a
   one-task step (``srun --pty bash``, ``srun -n1 python -m app``) are not ranks: the app launches
   the layout's ranks itself there, as on any machine.
3. A task of a multi-task submitit *local* job (SUBMITIT_LOCAL_GLOBALID, SUBMITIT_LOCAL_NTASKS).
4. RANK and WORLD_SIZE set by hand.

Otherwise the app launches ``layout.world_size`` local ranks. Which launcher then runs the
process is picked from the :class:`RankEnv` read here, in app/launch/launcher.py.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from app.output.pictures import ENV as PICTURES_VARIABLE  # the launcher's picture service
from rlcomm.net.env import (
    GLOO_SOCKET_IFNAME,
    LOCAL_RANK,
    LOCAL_WORLD_SIZE,
    MASTER_ADDR,
    MASTER_PORT,
    MAX_RESTARTS,
    NCCL_SOCKET_IFNAME,
    RANK,
    RANK_VARIABLES,
    RESTART_COUNT,
    USE_AGENT_STORE,
    WORLD_SIZE,
)

if TYPE_CHECKING:
    from app.api import RankEnv  # imported where needed: ``launched_by`` must stay cheap

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

# The app's own variables, set where a job starts and inherited by its ranks.
RUN_ID_VARIABLE = "RLCOMM_RUN_ID"  # the run directory's name every rank of a joined run agrees on
JOB_START_VARIABLE = "RLCOMM_JOB_START"  # time.time() when the job started
TIMELINE_VARIABLE = "RLCOMM_TIMELINE"  # the launcher's marks (app/output/timeline.py)
FORKSERVER_VARIABLE = "RLCOMM_FORKSERVER"  # the launcher's forkserver (app/launch/forkserver.py)
ENGINE_VARIABLE = "RLCOMM_ENGINE"  # "ray" in a rank a Ray actor started (app/launch/ray_rank.py)
_PROCESS_START = time.time()  # roughly this process's start: the app imports this module early

# Every variable through which a launcher describes a rank: tests and benchmarks scrub these to
# start the app as from a fresh shell. (The SLURM launcher strips only rlcomm.net.env's
# RANK_VARIABLES from the jobs it submits: see app/hydra/submitit.py.)
LAUNCHER_VARIABLES = (
    *RANK_VARIABLES, "GROUP_RANK", "ROLE_RANK", RUN_ID_VARIABLE, JOB_START_VARIABLE,
    TIMELINE_VARIABLE, FORKSERVER_VARIABLE, ENGINE_VARIABLE, PICTURES_VARIABLE,
    GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME,
)
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "SUBMITIT_")


def is_launcher_variable(name: str) -> bool:
    return name in LAUNCHER_VARIABLES or name.startswith(LAUNCHER_PREFIXES)


def without_launcher_variables(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as a shell outside any launcher would have it."""
    return {k: v for k, v in env.items() if not is_launcher_variable(k)}


def launched_by(env: Mapping[str, str] | None = None) -> str:
    """:attr:`RankEnv.launcher` alone, from ``env`` (default: the process environment): cheap
    enough for ``python -m app`` to ask before its own imports (app/launch/forkserver.py)."""
    env = os.environ if env is None else env
    if env.get(ENGINE_VARIABLE) == "ray" and RANK in env:
        return "ray"
    if "TORCHELASTIC_RUN_ID" in env and RANK in env:
        return "torchrun"
    if slurm_step(env) is not None:
        return "slurm" if int(env["SLURM_NTASKS"]) > 1 else "local"
    if (env.get("SUBMITIT_EXECUTOR") == "local" and "SUBMITIT_LOCAL_GLOBALID" in env
            and int(env.get("SUBMITIT_LOCAL_NTASKS", "1")) > 1):
        return "submitit"
    if RANK in env and WORLD_SIZE in env:
        return "env"
    return "local"


def resolve_rank_env(env: Mapping[str, str] | None = None) -> RankEnv:
    """This process's :class:`RankEnv`, from ``env`` (default: the process environment)."""
    from app.api import RankEnv

    env = os.environ if env is None else env
    node = socket.gethostname()
    restarts = int(env.get(RESTART_COUNT) or 0)
    launcher = launched_by(env)
    if launcher == "ray":  # the Ray engine's ranks see what torchrun's would, and its run id
        return _from_torch_variables("ray", env, node, restarts,
                                     f"ray-{env.get('TORCHELASTIC_RUN_ID', '')}")
    if launcher == "torchrun":
        return _from_torch_variables("torchrun", env, node, restarts, _torchrun_name(env))
    step = slurm_step(env)
    if launcher == "slurm" and step is not None:
        return _from_slurm(env, step, node, restarts)
    if step is not None:
        return RankEnv("local", node=node)  # e.g. srun --pty bash; srun -n1 python -m app
    if launcher == "submitit":
        return _from_submitit(env, node, restarts)
    if launcher == "env":
        name = f"join-{env.get(MASTER_ADDR, 'local')}-{env[MASTER_PORT]}" if MASTER_PORT in env else None
        return _from_torch_variables("env", env, node, restarts, name)
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        note = (
            f"inside SLURM job {env['SLURM_JOB_ID']} ({env['SLURM_NTASKS']} tasks) but not in an "
            "srun job step: launching every rank on this node; run `srun python -m app ...` to "
            "make each SLURM task one rank"
        )
        return RankEnv("local", node=node, run_name=env.get(RUN_ID_VARIABLE), note=note)
    return RankEnv("local", node=node, run_name=env.get(RUN_ID_VARIABLE))


def _from_slurm(
    env: Mapping[str, str], step: tuple[int, int], node: str, restarts: int
) -> RankEnv:
    """A task of an srun job step with more than one task."""
    from app.api import RankEnv

    node_id = int(env.get("SLURM_NODEID", "0"))
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    ntasks = int(env["SLURM_NTASKS"])
    job = str(step[0])
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return RankEnv(
        "slurm",
        rank=int(env["SLURM_PROCID"]),
        world_size=ntasks,
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        local_world_size=tasks_on_node(per_node, node_id) or ntasks,
        node=node,
        master_addr=first_host(nodelist) if nodelist else node,
        master_port=int(env.get(MASTER_PORT) or master_port(*step)),
        # A requeued job (scontrol requeue, a node failure) is this run restarted: it
        # continues in its own run dir (app/launch/rundir.py) from its newest checkpoint.
        restart_count=restarts + int(env.get("SLURM_RESTART_COUNT") or 0),
        run_name=env.get(RUN_ID_VARIABLE) or f"slurm-{job}.{step[1]}",
    )


def _from_submitit(env: Mapping[str, str], node: str, restarts: int) -> RankEnv:
    """A task of a multi-task submitit local job."""
    from app.api import RankEnv

    ntasks = int(env.get("SUBMITIT_LOCAL_NTASKS", "1"))
    rank = int(env["SUBMITIT_LOCAL_GLOBALID"])
    job_id = int(env["SUBMITIT_LOCAL_JOB_ID"])
    return RankEnv(
        "submitit",
        rank=rank,
        world_size=ntasks,
        local_rank=int(env.get("SUBMITIT_LOCAL_LOCALID", str(rank))),
        local_world_size=ntasks,
        node=node,
        master_addr="127.0.0.1",
        master_port=int(env.get(MASTER_PORT) or master_port(job_id)),
        restart_count=restarts,
        run_name=env.get(RUN_ID_VARIABLE),
    )


def _from_torch_variables(
    launcher: str, env: Mapping[str, str], node: str, restarts: int, run_name: str | None
) -> RankEnv:
    from app.api import RankEnv

    rank, world = int(env[RANK]), int(env[WORLD_SIZE])
    port, limit = env.get(MASTER_PORT), env.get(MAX_RESTARTS)
    local_world = int(env.get(LOCAL_WORLD_SIZE) or world)
    note = None
    if limit and int(limit) > 0 and local_world < world and env.get(USE_AGENT_STORE) == "True":
        note = (
            f"torchrun --max-restarts {limit} across hosts: torch {torch_version()} lets a host "
            "restarted by hand rejoin only when every torchrun runs with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (else its agent waits forever for the store "
            "address); the hosts that stayed up restart their ranks either way"
        )
    return RankEnv(
        launcher,
        rank=rank,
        world_size=world,
        local_rank=int(env.get(LOCAL_RANK) or rank),
        local_world_size=local_world,
        node=node,
        master_addr=env.get(MASTER_ADDR, ""),
        master_port=int(port) if port else None,
        restart_count=restarts,
        max_restarts=int(limit) if limit else None,
        run_name=env.get(RUN_ID_VARIABLE) or run_name,
        note=note,
    )


def torch_version() -> str:
    """torch's version from its metadata: importing torch here would slow every start."""
    from importlib.metadata import version

    return version("torch").split("+")[0]


def _torchrun_name(env: Mapping[str, str]) -> str:
    rdzv = env["TORCHELASTIC_RUN_ID"]
    if rdzv not in ("", "none"):
        return f"torchrun-{rdzv}"
    # Every local worker shares its agent (the parent): name the run after it.
    return f"torchrun-{os.getppid()}-{_start_ticks(os.getppid())}"


def submitit_executor(env: Mapping[str, str] | None = None) -> str | None:
    """``slurm`` or ``local`` in a task of a job submitit submitted, else None."""
    env = os.environ if env is None else env
    return env.get("SUBMITIT_EXECUTOR") or None


def slurm_step(env: Mapping[str, str]) -> tuple[int, int] | None:
    """``(job id, step id)`` when this process is a task of an srun job step, else None."""
    step, job = env.get("SLURM_STEP_ID", ""), env.get("SLURM_JOB_ID", "")
    if not (step.isdigit() and job.isdigit()) or int(step) >= _FIRST_SPECIAL_STEP_ID:
        return None
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    return int(job), int(step)


def master_port(job_id: int, step_id: int = 0) -> int:
    """A rendezvous port for one job step: distinct for jobs with nearby ids (an array's jobs) and
    for up to 8 concurrent steps of one job."""
    slot = job_id * _STEPS_PER_JOB + step_id % _STEPS_PER_JOB
    return _PORT_BASE + slot % _PORT_SPAN


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``gpu[003-004,010],cpu01`` (submitit's parser)."""
    if not nodelist:
        return socket.gethostname()
    from app.launch.private import parse_node_list

    return parse_node_list(nodelist)[0]


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
    ``srun`` steps of one batch script get one folder each. RLCOMM_RUN_ID, when set, wins.
    """
    name = resolve_rank_env().run_name
    if name:
        return name
    from datetime import datetime

    return datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")


def output_subdir() -> str | None:
    """Only the first rank of a joined run writes Hydra's ``.hydra/`` folder."""
    return ".hydra" if resolve_rank_env().rank == 0 else None


def _start_ticks(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[19]
    except (OSError, IndexError):
        return "0"


def mark_job_start() -> None:
    """Called where a job starts (the app's entry point, once per sweep job)."""
    os.environ[JOB_START_VARIABLE] = repr(time.time())


def job_start_time() -> float:
    """When this job started: the mark, else this process's start (a rank started another way,
    e.g. a test calling ``run_rank`` directly)."""
    mark = os.environ.get(JOB_START_VARIABLE)
    return float(mark) if mark else _PROCESS_START
