"""One rank under the Ray engine: :class:`RankActor` holds the rank's place and resources on
the cluster, and runs the rank in a child process (``python -m app.launch.ray_rank``) with the
same rank code as the local launcher's (``run_rank_here``).

Why a child and not the actor's own process: the rank forks (slots, side jobs), handles
SIGTERM and SIGUSR1 on its main thread and is named ``rlcomm-rank<N>``, none of which a Ray
worker process allows or expects. The child is tied to the actor (``PR_SET_PDEATHSIG``): an
actor Ray kills (``ray.kill``, a lost node, the driver's end) takes its rank with it.

This module imports without Ray: the driver makes the class remote (app/launch/ray_engine.py).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

ACTOR_PID_VARIABLE = "RLCOMM_RAY_ACTOR_PID"  # the rank's parent, checked after it ties itself


class RankActor:
    """The actor of one rank: where it landed (:meth:`where`), the rank's child process
    (:meth:`run`), and signals for it (:meth:`signal`) while :meth:`run` waits."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # what Ray calls the actor in its own messages
        return f"rlcomm-rank{self.rank}"

    def where(self) -> dict[str, Any]:
        """Ray's node id, the node's IP, this host's name and the actor's pid."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "pid": os.getpid()}

    def run(self, payload: bytes, environ: dict[str, str], cwd: str) -> int:
        """Runs the rank (``payload``: the pickled job, plan and run dir) to its end; returns
        its exit status (negative: the signal that ended it)."""
        environ = {**environ, ACTOR_PID_VARIABLE: str(os.getpid())}
        with self._lock:
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__], stdin=subprocess.PIPE, env=environ,
                cwd=cwd if os.path.isdir(cwd) else None)
        assert self._child.stdin is not None
        try:
            self._child.stdin.write(payload)
            self._child.stdin.close()
        except BrokenPipeError:  # it died at once; its status says how
            pass
        return self._child.wait()

    def signal(self, signum: int) -> bool:
        """Sends ``signum`` to the rank; False where it is not running."""
        with self._lock:
            child = self._child
        if child is None or child.poll() is not None:
            return False
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            return False
        return True


def _main() -> None:
    """The rank's child process: tied to its actor, then the rank as the local launcher runs it."""
    from app.launch.lifeline import die_with_parent

    die_with_parent()
    if str(os.getppid()) != os.environ.get(ACTOR_PID_VARIABLE):  # the actor died before the tie
        os.kill(os.getpid(), signal.SIGKILL)
    from app.launch.ray_growth import JOIN

    payload = pickle.load(sys.stdin.buffer)
    if payload[0] == JOIN:  # a rollout rank beyond the plan (app/launch/ray_growth.py)
        from app.join import main as join

        sys.exit(join([payload[1], "role=rollout"]))
    job, plan, run_dir = payload
    from app.launch.local import run_rank_here

    run_rank_here(job, plan, run_dir)


if __name__ == "__main__":
    try:
        _main()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # its traceback is in the rank's log (run_rank); the driver names it
        sys.exit(1)
