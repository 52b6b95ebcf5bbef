"""Real processes for the benchmarks: forked ranks on 127.0.0.1, and timed subprocesses.

Ranks are forked from this process by :func:`rlcomm.testing.run_ranks` (torch is already
imported, so a rank starts in milliseconds); a rank that raises or hangs fails the whole call.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from app.launch.environment import without_launcher_variables
from rlcomm.testing import run_ranks

REPO_ROOT = Path(__file__).resolve().parent.parent

def backend_for(world_size: int) -> str:
    """nccl when every rank can have its own GPU, else gloo."""
    return "nccl" if torch.cuda.device_count() >= world_size else "gloo"


def rank_device(rank: int, backend: str) -> torch.device:
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def sync_fn(group: dist.ProcessGroup | None, backend: str) -> Callable[[], None]:
    """A barrier on ``group`` that also waits for queued GPU work under nccl."""

    def sync() -> None:
        if backend == "nccl":
            torch.cuda.synchronize()
        dist.barrier(group=group)

    return sync


def run_forked(fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> Any:
    """``fn(*args)`` in one fresh forked process (clean torch.distributed state, own RSS)."""
    return run_ranks(_single, 1, fn, args, timeout=timeout)[0]


def _single(rank: int, world_size: int, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    return fn(*args)


class CommandTimeoutError(RuntimeError):
    """A subprocess ran past its deadline; it was killed with everything it started."""

    def __init__(self, message: str, stderr: str) -> None:
        super().__init__(message)
        self.stderr = stderr


def users_environment() -> dict[str, str]:
    """This process's environment as a user's shell has it: no launcher's variables, and
    Python's default of caching compiled modules (a machine that turns that off for itself,
    with PYTHONDONTWRITEBYTECODE, would time the app's compilation on every start)."""
    env = without_launcher_variables(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def timed_command(
    argv: Sequence[str], timeout: float, cwd: Path = REPO_ROOT
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Wall seconds of one subprocess, and its completed process (output captured).

    The command runs in its own session, so that on timeout the ranks it launched are killed
    with it (by its process group) instead of being left running.
    """
    env = users_environment()
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        last = [line for line in err.splitlines() if line.strip()][-3:]
        raise CommandTimeoutError(
            f"{' '.join(argv)} did not finish within {timeout:.0f} s; last output: "
            + " / ".join(last),
            err,
        ) from None
    seconds = time.perf_counter() - start
    return seconds, subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def kill_rank(launcher: int, rank: int) -> float | None:
    """SIGKILLs the process named ``rlcomm-rank<rank>`` under the process ``launcher`` (a
    rank's own process, not its slot); when (time.time()), or None if there is none."""
    for child in psutil.Process(launcher).children(recursive=True):
        try:
            if child.name() == f"rlcomm-rank{rank}":
                child.kill()
                return time.time()
        except psutil.NoSuchProcess:
            continue
    return None
