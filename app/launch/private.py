"""Every private API of torch, Python, Hydra and submitit that the launch room relies on, in one
place.

Nothing here is documented by its owner; each one is pinned by tests/unit/test_private_apis.py
(or, where only real processes show it, tests/integration/test_local_launcher_private_apis.py),
so an upgrade that changes one fails there, with its name, and not in a user's run. Why each is
needed, and what it would take to drop it: docs/launch.md (Private APIs).

Subclass hooks (``StaticTCPRendezvous``'s attributes in app/launch/local.py, the Hydra submitit
plugin's in app/hydra/submitit.py) stay in their subclasses: they are the only way in.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.process
import os
import sys
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

# The elastic agent's log texts that its records are told apart by (torch 2.13:
# agent/server/api.py and multiprocessing/api.py): no logger name or record field says which.
AGENT_RESTART_TEXT = "will restart worker group"
WORKER_FAILED_PREFIX = "failed (exitcode"


def started_processes() -> list[BaseProcess]:
    """The Process objects this process started and has not joined yet (the elastic agent's
    ranks among them). ``multiprocessing.active_children()`` would join the ended ones, reading
    their exit codes from under the agent's thread; this list reads nothing."""
    return list(multiprocessing.process._children)  # type: ignore[attr-defined]


def open_files(pid: int) -> Iterator[Path]:
    """The files process ``pid`` holds open (Linux: the links in ``/proc/<pid>/fd``); nothing
    once it is gone."""
    with contextlib.suppress(OSError):  # gone, or a descriptor closed while read: none
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            yield Path(os.readlink(fd))


def name_agent_host(name: str) -> None:
    """The elastic agent names this host ``name`` in the events it records, instead of looking
    it up (``socket.getfqdn``: a DNS query, unbounded where the resolver is slow)."""
    from torch.distributed.elastic.agent.server import api, local_elastic_agent

    api._get_fq_hostname = lambda: name
    local_elastic_agent.LocalElasticAgent._get_fq_hostname = lambda self: name  # type: ignore[method-assign]


def in_forkserver_preload() -> bool:
    """Whether multiprocessing's forkserver (``multiprocessing.forkserver.main``) is importing
    the caller's module as its preload: the only code a forkserver runs before it forks."""
    import inspect
    from multiprocessing import forkserver

    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def fork_forkserver(preload: list[str]) -> int:
    """Starts multiprocessing's forkserver as a fork of this process that runs
    ``multiprocessing.forkserver.main``, where ``forkserver.ensure_running`` starts a new
    interpreter: what this process imported, the forkserver holds without importing it again.
    Only for a process that holds one thread. Returns the forkserver's pid; afterwards
    ``ensure_running`` finds it running (and starts a new interpreter if it died)."""
    import socket
    from multiprocessing import connection, forkserver, resource_tracker, util

    server: Any = forkserver._forkserver
    resource_tracker.ensure_running()  # the launcher's, as with ensure_running
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # Every client holds the write end; the forkserver ends when it reads EOF.
        alive_r, alive_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # a fork would write their buffers twice
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the forkserver: it never returns into the launcher's code
            code = 1
            try:
                os.close(alive_w)
                forkserver.main(listener.fileno(), alive_r, preload)
                code = 0
            finally:
                os._exit(code)
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid
    return pid


def parse_node_list(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list such as ``gpu[003-004,010],cpu01`` (submitit's parser)."""
    from submitit.slurm.slurm import _parse_node_list

    return [str(host) for host in _parse_node_list(nodelist)]


class AgentRestartNotice(logging.Filter):
    """Of the agent's INFO lines, only "Worker group FAILED. 1/1 attempts left; will restart
    worker group" gets through: a restart after a failed rank should not be silent."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or AGENT_RESTART_TEXT in str(record.msg)


class NoWorkerTraceback(logging.Filter):
    """The agent's "failed (exitcode: 1) local_rank: ..." record, with the rank's traceback, is
    kept off the console: the rank's log file holds that traceback, and the launcher's one
    ``error:`` line names the cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(WORKER_FAILED_PREFIX)


def one_line_override_errors() -> None:
    """An override Hydra cannot apply (a key the loop's schema has not: ``loop.replay.checkpoint``
    on PPO) ends ``python -m app`` with one line and exit code 2, as the app's own checks do,
    instead of Hydra's three lines and exit code 1. Hydra prints its errors inside
    ``hydra._internal.utils.run_and_report``, which ``hydra.main`` calls; nothing public lets an
    app print them itself."""
    from hydra._internal import utils
    from hydra.errors import ConfigCompositionException

    reporting = utils.run_and_report
    if getattr(reporting, "one_line", False):
        return

    def run_and_report(func: Any) -> Any:
        def guarded() -> Any:
            try:
                return func()
            except ConfigCompositionException as err:
                line = override_error_line(err)
                if line is None:
                    raise
                from app.errors import say_error

                say_error(line)
                sys.exit(2)

        return reporting(guarded)

    run_and_report.one_line = True  # type: ignore[attr-defined]
    utils.run_and_report = run_and_report


def override_error_line(err: BaseException) -> str | None:
    """``Could not override 'a.b'`` with its cause (``Key 'b' not in 'Schema'``) as one line
    naming the override: ``a.b: Key 'b' not in 'Schema'``; ``Error merging override a.b=v``
    likewise, with the refusal's first line; None for any other error."""
    first = str(err).split("\n", 1)[0]
    if err.__cause__ is None or not str(err.__cause__).strip():
        return None
    cause = str(err.__cause__).strip().splitlines()[0]
    if first.startswith("Error merging override "):
        # A value its type refuses: launcher.engine=kubernetes, comm.timeout=abc.
        return f"{first[len('Error merging override '):].partition('=')[0]}: {cause}"
    if not first.startswith("Could not override '"):
        return None
    key = first[len("Could not override '"):].rstrip(".").rstrip("'")
    return f"{key}: {cause}"
