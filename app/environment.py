"""Where this process stands: launching ranks itself, or joining ranks that already exist.

Join mode is detected from the environment: torchrun/torchelastic (TORCHELASTIC_RUN_ID) first,
since it can run inside SLURM; then a submitit or plain srun task (SLURM_PROCID + SLURM_NTASKS);
then RANK and WORLD_SIZE set by hand. Otherwise the app launches ``layout.world_size`` local ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Placement:
    kind: str  # "local" | "torchrun" | "slurm" | "env"
    rank: int = 0
    world_size: int = 1


def detect_placement() -> Placement:
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
        return Placement("torchrun", int(env["RANK"]), int(env["WORLD_SIZE"]))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in (
        "bash",
        "interactive",
    ):
        return Placement("slurm", int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]))
    if "RANK" in env and "WORLD_SIZE" in env:
        return Placement("env", int(env["RANK"]), int(env["WORLD_SIZE"]))
    return Placement("local")


def export_distributed_env(placement: Placement) -> None:
    """Make RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT describe
    this process, whatever started it (local agent and torchrun set them already)."""
    if placement.kind != "slurm":
        return
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def run_id() -> str:
    """A run directory name that every rank of one joined run computes alike.

    Each rank of a joined run is its own Hydra process and would otherwise resolve ``${now:}``
    itself and scatter the run over several folders.
    """
    env = os.environ
    if env.get("RLCOMM_RUN_ID"):
        return env["RLCOMM_RUN_ID"]
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        return f"slurm-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}"
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
