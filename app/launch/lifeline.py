"""A rank ends with the launcher that started it, even when the launcher is SIGKILLed.

``kill -9`` of the launcher (the OOM killer, a batch system's hard limit) runs no handler, so
nobody stops the ranks. torch's spawn asks the kernel for a SIGINT on parent death, but a rank
blocked in a collective only acts on SIGINT when the call returns (possibly at the group's
timeout), and a rank torchrun starts with a command line gets nothing. So each rank asks the
kernel for SIGKILL instead (``prctl(PR_SET_PDEATHSIG)``): it cannot be caught or deferred, costs
nothing while the launcher lives, and needs no thread, socket or store. Once every rank is gone,
multiprocessing's resource tracker (the launcher's other child) reads end-of-file on its pipe,
whose last writers were the launcher and the ranks, and exits too.

The kernel sends the signal when the *thread* that started the rank ends: the elastic agent
starts its ranks from the thread that runs it (the main thread of ``python -m app``, or of
torchrun), which ends only with the process.

The app's local ranks are forked by its forkserver (app/launch/forkserver.py), a child the
launcher starts from its main thread: the forkserver asks for SIGKILL when the launcher dies, and
each rank when the forkserver does, so a SIGKILLed launcher still takes every rank with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Mapping

from app.launch.environment import resolve_rank_env

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_INIT_PID = 1


def tie_to_launcher(launched_here: bool, environ: Mapping[str, str] | None = None) -> int | None:
    """SIGKILL this rank when the process that launched it ends; returns that process's pid.

    Only a rank with a supervising parent is tied: one the app's local launcher spawned
    (``launched_here``) or one torchrun's agent started. A rank started by hand, by srun (SLURM
    ends a step's tasks itself) or by submitit is left alone: its parent may be a shell that
    exits while the run goes on (``nohup``). Returns None when nothing was tied.
    """
    if not sys.platform.startswith("linux"):
        return None
    if launched_here:
        # spawn and the forkserver tell the child the launcher's pid (the Process object's
        # creator); a rank the launcher's forkserver forked has the forkserver as its parent.
        spawner = multiprocessing.parent_process()
        if spawner is None or spawner.pid is None:  # called in the launching process itself
            return None
        expected: int | None = spawner.pid
        parent = os.getppid()
        if parent != spawner.pid and parent_of(parent) == spawner.pid:
            expected = parent  # the launcher's forkserver, tied to the launcher itself
    elif resolve_rank_env(environ).launcher == "torchrun":
        expected = None  # torchrun's agent passes no pid: only a rank adopted by init is known
    else:
        return None
    die_with_parent()
    # The launcher may have died before the request: then this rank was already adopted.
    parent = os.getppid()
    orphaned = parent != expected if expected is not None else parent == _INIT_PID
    if orphaned:
        with contextlib.suppress(OSError, ValueError):  # nobody may be reading
            print(f"rank (pid {os.getpid()}): its launcher (pid {expected or 'unknown'}) is "
                  "gone; stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return parent


def die_with_parent() -> None:
    """Asks the kernel for SIGKILL when this process's parent (the thread that forked it) ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def parent_of(pid: int) -> int | None:
    """The parent pid of process ``pid``, from /proc; None once it is gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115
        return int(stat.rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None
