"""The one place rlcomm reads the process environment (torch's launcher conventions).

As in the original CommContext (see :mod:`rlcomm.context`), ``init_distributed_env`` takes
world size and rank from WORLD_SIZE and RANK when they are not given; the rendezvous reads
MASTER_ADDR/MASTER_PORT for ``env://``. A missing or malformed variable is an error that names
it. Launchers (torchrun, SLURM, the app) set these.
"""

from __future__ import annotations

import os

from rlcomm.errors import EnvironmentConfigError

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
# Set by torch's elastic agent in its workers.
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"

# What torch.distributed needs to describe one rank; launchers set them, tests scrub them.
RANK_VARIABLES = (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)


def env_int(name: str, default: int | None = None) -> int:
    """An integer environment variable; a missing or malformed one is an error naming it."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is not None:
            return default
        raise EnvironmentConfigError(f"environment variable {name} is not set")
    try:
        return int(raw)
    except ValueError:
        raise EnvironmentConfigError(
            f"environment variable {name}={raw!r} is not an integer"
        ) from None


def world_size_and_rank(world_size: int | None, rank: int | None) -> tuple[int, int]:
    """``init_distributed_env``'s defaults: WORLD_SIZE and RANK from the environment when not
    given."""
    world_size = env_int(WORLD_SIZE) if world_size is None else world_size
    rank = env_int(RANK) if rank is None else rank
    if not 0 <= rank < world_size:
        raise EnvironmentConfigError(f"rank {rank} is out of range for world_size {world_size}")
    return world_size, rank


def in_node_rank() -> int | None:
    """LOCAL_RANK, else SLURM_LOCALID (a plain srun task), else None."""
    for name in (LOCAL_RANK, "SLURM_LOCALID"):
        if os.environ.get(name):
            return env_int(name)
    return None


def local_world_size() -> int | None:
    return env_int(LOCAL_WORLD_SIZE) if os.environ.get(LOCAL_WORLD_SIZE) else None


def master_address() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, for ``env://``."""
    host = os.environ.get(MASTER_ADDR)
    if not host:
        raise EnvironmentConfigError(f"environment variable {MASTER_ADDR} is not set (env://)")
    return host, env_int(MASTER_PORT)


def restart_count() -> int:
    """How often torch's elastic agent restarted this worker group (0 outside an agent)."""
    return env_int(RESTART_COUNT, 0)


def uses_agent_store() -> bool:
    """Under torchrun the agent hosts the rendezvous store; every worker is a client."""
    return os.environ.get(USE_AGENT_STORE) == "True"
