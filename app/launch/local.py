"""Start ``layout.world_size`` local ranks through torch's elastic agent (torchrun's engine).

The agent's rendezvous store listens on 127.0.0.1 only, on a port the kernel picks, so two runs
on one machine never collide and nothing is exposed beyond loopback. The ranks are forked from
the app's forkserver (app/launch/forkserver.py), which imported torch and the app once.

A finished run exits promptly, always: a rank that finished but does not exit within
``launcher.shutdown_timeout`` names what holds it in its log and ends itself (exit code 0,
:func:`_exit_guard`); one that cannot (stuck with the interpreter lock held) is named and
killed by the launcher (:class:`DeathWatch`) twice that long after ``result.json`` appeared,
and the run still succeeds.

An elastic rollout rank (``plan.elastic_rollouts``) runs in a child of the process the agent
started, a slot (app/launch/slots.py) that outlives it: a lost rollout rank does not stop the
others, and is started again ``launcher.rollout_restarts`` times.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import socket
import sys
import threading
import time
import uuid
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from app.errors import WRITE_ERRORS, LaunchInterruptedError, RankFailedError
from app.launch import forkserver, slots
from app.launch.failures import (
    Kind,
    drop_unreadable_error_file,
    read_records,
    write_error_line,
)
from app.launch.lifeline import tie_to_launcher
from app.launch.rank import run_rank
from app.output.logs import console_handler
from rlcomm import LayoutPlan

LOOPBACK = "127.0.0.1"
_BACKEND = "rlcomm-loopback"


class LoopbackRendezvous(StaticTCPRendezvous):
    """A single-node static rendezvous whose store binds 127.0.0.1 on a free port."""

    def get_backend(self) -> str:
        return _BACKEND

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._listener = socket.create_server((LOOPBACK, 0), backlog=1024)
            self.master_port = self._listener.getsockname()[1]
            self._store = TCPStore(
                LOOPBACK,
                self.master_port,
                None,
                True,
                self.timeout,
                wait_for_workers=False,
                master_listen_fd=self._listener.fileno(),
            )
        store = PrefixStore(self.run_id, self._store)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(LOOPBACK, self.master_port))

    def shutdown(self) -> bool:
        self._store = None
        if getattr(self, "_listener", None) is not None:
            self._listener.close()
        return True


class _RestartNotice(logging.Filter):
    """Of the agent's INFO lines, only "Worker group FAILED. 1/1 attempts left; will restart
    worker group" gets through: a restart after a failed rank should not be silent."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "will restart worker group" in str(record.msg)


class _NoWorkerTraceback(logging.Filter):
    """The agent's "failed (exitcode: 1) local_rank: ..." record, with the rank's traceback, is
    kept off the console: the rank's log file holds that traceback, and the launcher's one
    ``error:`` line names the cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode")


def _create_handler(params: RendezvousParameters) -> LoopbackRendezvous:
    return LoopbackRendezvous(LOOPBACK, 0, 0, 1, params.run_id, int(params.get("timeout", 600)))


def launch_local(config: dict[str, Any], plan: LayoutPlan, run_dir: Path) -> dict[str, Any]:
    """Run every rank locally; returns rank 0's summary or raises RankFailedError."""
    cfg = OmegaConf.create(config)
    rendezvous_handler_registry.register(_BACKEND, _create_handler)  # the same creator: a no-op
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    worker_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _NoWorkerTraceback) for f in worker_log.filters):
        worker_log.addFilter(_NoWorkerTraceback())
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent_log.setLevel(logging.INFO)
    if not any(isinstance(f, _RestartNotice) for f in agent_log.filters):
        agent_log.addFilter(_RestartNotice())
        # The agent speaks while rank 0's progress bar is on the same terminal: above it.
        agent_log.addHandler(console_handler("launcher"))
        agent_log.propagate = False
    _no_name_lookups()
    # Started at the app's first line already (python -m app); here for any other way in.
    start_method = forkserver.START_METHOD if forkserver.start() else "spawn"
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=plan.world_size,
        run_id=f"rlcomm-{uuid.uuid4().hex[:8]}",
        rdzv_backend=_BACKEND,
        rdzv_endpoint=f"{LOOPBACK}:0",
        rdzv_configs={"timeout": int(cfg.comm.timeout)},
        max_restarts=cfg.launcher.max_restarts,
        monitor_interval=cfg.launcher.monitor_interval,
        start_method=start_method,
        local_addr=LOOPBACK,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs" / "elastic")),
    )
    launch.shutdown_timeout = cfg.launcher.shutdown_timeout
    deaths = DeathWatch(run_dir / "logs", plan.world_size, result=run_dir / "result.json",
                        exit_bound_s=2 * float(cfg.launcher.shutdown_timeout))
    previous = signal.signal(signal.SIGUSR1,
                             lambda *_: _forward_to_ranks(signal.SIGUSR1, run_dir, deaths))
    try:
        # The launcher's environment travels with the ranks: a forked rank adopts it.
        elastic_launch(launch, _local_rank)(config, plan, str(run_dir), dict(os.environ))
    except ChildFailedError as err:
        if not deaths.only_stragglers_failed():
            raise RankFailedError(
                _describe_failures(err, run_dir, deaths.killed())
            ) from None
        # Every rank finished; the ones that would not exit were named and killed.
    except SignalException as err:  # the agent forwarded the signal to every rank and waited
        name = signal.Signals(err.sigval).name
        raise LaunchInterruptedError(
            f"interrupted by {name}: stopped all {plan.world_size} ranks "
            f"(logs: {run_dir / 'logs'})",
            int(err.sigval),
        ) from None
    finally:
        deaths.stop()
        signal.signal(signal.SIGUSR1, previous)
    # Rank 0 reports through result.json (JSON), not through the agent's pickled return values.
    return read_result(run_dir)


def read_result(run_dir: Path) -> dict[str, Any]:
    """Rank 0's ``result.json``; a missing or unreadable one (a write that failed) is one line."""
    path = run_dir / "result.json"
    try:
        summary: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        why = write_error_line(err) if isinstance(err, OSError) else None
        if why is None:
            why = "it is missing" if isinstance(err, FileNotFoundError) else (
                f"it is not JSON ({type(err).__name__}: {_last_line(str(err))})"
            )
        raise RankFailedError(
            f"the ranks ended, but rank 0's summary {path} cannot be read: {why}"
            f"{_disk_state(run_dir)}"
        ) from None
    return summary


def _local_rank(
    config: dict[str, Any], plan: LayoutPlan, run_dir: str, launcher_env: dict[str, str]
) -> None:
    forkserver.adopt_launcher_environment(launcher_env)
    rank = int(os.environ.get("RANK", "-1"))
    if getattr(plan, "elastic_rollouts", False) and rank in plan.rollouts:
        # A lost rollout rank must not end this process: the agent would stop every rank.
        if slots.can_fork():
            tie_to_launcher(launched_here=True)  # the slot as a rank is: its child is tied to it
            restarts = int(config["launcher"].get("rollout_restarts", 0))
            slots.supervise(rank, lambda _incarnation: _run_rank_here(config, plan, run_dir),
                            restarts, Path(run_dir), _launcher_log())
            return
        _launcher_log().warning("rank %d: its process runs other threads and cannot fork a "
                                "rank it survives; losing this rank fails the run", rank)
    _run_rank_here(config, plan, run_dir)


def _run_rank_here(config: dict[str, Any], plan: LayoutPlan, run_dir: str) -> None:
    """The rank, in this process: the agent's worker process, or a slot's child
    (app/launch/slots.py)."""
    forkserver.set_process_name(f"rlcomm-rank{os.environ.get('RANK', '')}")  # ps, top
    try:
        run_rank(config, plan, run_dir, launched_here=True)
    except Exception:
        if drop_unreadable_error_file():
            # Re-raised, the exception would make torch write the error file again, on the
            # same full disk: the agent would then fail reading it (JSONDecodeError). The
            # rank's own failure record, written into room kept for it, says what failed.
            sys.exit(1)
        raise
    grace = float(config["launcher"]["shutdown_timeout"])
    _exit_guard(Path(run_dir) / "result.json", grace, float(config["comm"]["timeout"]) + grace)


def _exit_guard(result: Path, grace_s: float, give_up_s: float) -> None:
    """Bounds what is left of this finished rank: waiting for the others (until ``result``
    exists, rank 0's last step), then ``grace_s`` for this process to exit. A rank still alive
    then names what holds it (threads that do not end, children) in its log, with every
    thread's stack, and exits with code 0: its work is done. A daemon thread: it ends with the
    process and holds nothing."""
    finished = time.monotonic()

    def guard() -> None:
        while not result.exists() and time.monotonic() - finished < give_up_s:
            time.sleep(0.05)
        time.sleep(grace_s)
        holders = [f"thread {t.name!r}" for t in threading.enumerate()
                   if t is not threading.current_thread() and t.is_alive() and not t.daemon
                   and t is not threading.main_thread()]
        holders += [f"child process {p.pid}" for p in multiprocessing.active_children()]
        rank = os.environ.get("RANK", "?")
        log = logging.getLogger("app.launch.local")
        log.warning("rank %s finished %.1f s ago but has not exited (%s); ending it; the "
                    "stacks of its threads follow in its log", rank,
                    time.monotonic() - finished, ", ".join(holders) or "its main thread")
        for handler in logging.getLogger().handlers:
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.FileHandler) and stream is not None:
                with contextlib.suppress(Exception):
                    stream.flush()
                    faulthandler.dump_traceback(stream, all_threads=True)
                    stream.flush()
        logging.shutdown()
        os._exit(0)

    threading.Thread(target=guard, name="rlcomm-exit-guard", daemon=True).start()


def _forward_to_ranks(signum: int, run_dir: Path, deaths: DeathWatch) -> None:
    """``kill -USR1 <launcher>``: every rank writes its stacks and collective table to its log."""
    pids = deaths.running_pids()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    logging.getLogger("app").warning(
        "%s: %d ranks write their Python stacks and collectives to %s",
        signal.Signals(signum).name, len(pids), run_dir / "logs",
    )


def _no_name_lookups() -> None:
    """The elastic agent names this host in each worker event it records after the ranks end
    (``socket.getfqdn``: a DNS lookup, unbounded where the resolver is slow or unreachable), on
    the way from the last rank's exit to the launcher's. Its own name does: all ranks are here."""
    from torch.distributed.elastic.agent.server import api, local_elastic_agent

    name = socket.gethostname()
    api._get_fq_hostname = lambda: name
    local_elastic_agent.LocalElasticAgent._get_fq_hostname = lambda self: name  # type: ignore[method-assign]


class DeathWatch:
    """Which local rank died first, and whether a signal killed it, seen as it happens; and which
    finished rank does not exit.

    The agent reports one failed rank, whichever its poll finds first: often a peer that lost
    its connection to a rank killed a moment before, which wrote no error record. A thread looks
    at the rank processes the agent started (multiprocessing's Process objects of this process)
    every ``period_s``: a process has ended once its sentinel is ready, which reads nothing (the
    agent still collects every exit code), and each is known by the log file it holds open. Only
    the first deaths count: the ranks the agent then stops with SIGTERM are not causes. Their
    exit codes are read once the agent is done with them (:meth:`killed`).

    Once ``result`` (rank 0's result.json) exists, every rank has finished; a rank still running
    ``exit_bound_s`` later is named on the console and killed (:meth:`only_stragglers_failed`).
    """

    def __init__(self, log_dir: Path, world_size: int, result: Path | None = None,
                 exit_bound_s: float = 10.0, period_s: float = 0.05) -> None:
        self._log_dir, self._world_size, self._period_s = log_dir, world_size, period_s
        self._result, self._exit_bound_s = result, exit_bound_s
        self._ranks: dict[BaseProcess, int] = {}  # rank processes still running -> rank
        self._attempt: dict[BaseProcess, int] = {}  # every rank process of this attempt
        self._first: dict[BaseProcess, int] = {}  # the first scan's deaths -> rank
        self._attempt_over = False  # every rank ended: ranks seen next belong to a restart
        self._finished_at: float | None = None  # when result.json appeared (monotonic)
        self.stragglers: dict[int, int] = {}  # rank -> pid, killed for not exiting
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rlcomm-deaths", daemon=True)
        self._thread.start()

    def killed(self) -> dict[int, str]:
        """Ranks among the first to end that a signal killed, with the signal's name."""
        found = {}
        for proc, rank in self._first.items():
            code = proc.exitcode  # the agent has collected it: this reads nothing new
            if code is not None and code < 0:
                with contextlib.suppress(ValueError):
                    found[rank] = signal.Signals(-code).name
        return found

    def only_stragglers_failed(self) -> bool:
        """The run finished (result.json), and the only ranks that did not exit cleanly are the
        ones this watch killed because they did not exit after it."""
        if not self.stragglers or self._result is None or not self._result.exists():
            return False
        killed = set(self.stragglers.values())
        return all(p.exitcode == 0 or p.pid in killed for p in self._attempt)

    def running_pids(self) -> list[int]:
        return sorted(p.pid for p in list(self._ranks) if p.pid is not None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self._period_s):
            if len(self._ranks) < self._world_size:
                self._find_ranks()
            ended: dict[BaseProcess, int] = {}
            for proc in _ended(list(self._ranks)):
                ended[proc] = self._ranks.pop(proc)
            if ended and not self._first:
                self._first = ended
            if not self._ranks and self._first:
                self._attempt_over = True
            self._check_exits()

    def _find_ranks(self) -> None:
        # The Process objects this process started and did not join yet (the agent's ranks,
        # the launcher's side jobs); set and discarded by multiprocessing in this process.
        for proc in list(multiprocessing.process._children):  # type: ignore[attr-defined]
            if proc in self._ranks or proc in self._attempt or proc.pid is None:
                continue
            rank = self._rank_of(proc.pid)
            if rank is None:
                continue
            if self._attempt_over:  # the agent restarted the ranks
                self._first, self._attempt, self._attempt_over = {}, {}, False
            self._ranks[proc] = self._attempt[proc] = rank

    def _check_exits(self) -> None:
        if self._result is None or not self._ranks:
            return
        if self._finished_at is None:
            if not self._result.exists():
                return
            self._finished_at = time.monotonic()
        waited = time.monotonic() - self._finished_at
        if waited < self._exit_bound_s:
            return
        for proc, rank in list(self._ranks.items()):
            if rank in self.stragglers or proc.pid is None:
                continue
            self.stragglers[rank] = proc.pid
            _launcher_log().warning(
                "rank %d (pid %d) has not exited %.1f s after the run finished (%s); killing it "
                "(log: %s)", rank, proc.pid, waited, self._result.name,
                self._log_dir / f"rank{rank}.log")
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)

    def _rank_of(self, pid: int) -> int | None:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = Path(os.readlink(fd))
                if target.parent == self._log_dir and target.name.startswith("rank"):
                    with contextlib.suppress(ValueError):
                        return int(target.stem.removeprefix("rank"))
        return None


def _ended(procs: list[BaseProcess]) -> list[BaseProcess]:
    """Those of ``procs`` that have ended: their sentinel is ready (nothing is read from it)."""
    sentinels = {}
    for proc in procs:
        with contextlib.suppress(ValueError):  # closed: ended and collected long ago
            sentinels[proc.sentinel] = proc
    if not sentinels:
        return []
    return [sentinels[s] for s in multiprocessing.connection.wait(list(sentinels), timeout=0)
            if isinstance(s, int)]


def _launcher_log() -> logging.Logger:
    """``[launcher] ...`` lines on the console, above any progress bar."""
    log = logging.getLogger("rlcomm.launcher")
    if not log.handlers:
        log.addHandler(console_handler("launcher"))
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def _describe_failures(
    err: ChildFailedError, run_dir: Path, killed: dict[int, str] | None = None
) -> str:
    """One line naming the rank(s) that caused the failure, why, and where their logs are.

    The agent reports whichever failed rank it noticed first, often a peer that merely lost its
    connection; every rank's failure record (app/launch/failures.py) tells the cause apart, and
    ``killed`` (from :class:`DeathWatch`) names the ranks a signal killed, which leave none.
    """
    records = read_records(run_dir / "logs")
    why: dict[int, str] = {}
    kinds: dict[int, Kind] = {}
    writes: dict[int, str] = {}  # ranks that failed writing a file: the whole of their line
    failed_alone = any(record.kind != "peer_lost" for record in records.values())
    sigterms = {r for r, f in err.failures.items() if f.exitcode == -signal.SIGTERM}
    sigterms |= {r for r, name in (killed or {}).items() if name == "SIGTERM"}
    stopped = {r for r in sigterms if r in records or failed_alone}  # by the agent: not a cause
    for rank, failure in err.failures.items():
        if failure.exitcode < 0 and rank not in stopped:
            why[rank], kinds[rank] = f"killed by {failure.signal_name()}", "error"
    for rank in stopped - set(records):
        why[rank], kinds[rank] = "stopped by the launcher after another rank failed", "peer_lost"
    for rank, record in records.items():
        if rank not in why:
            code = err.failures[rank].exitcode if rank in err.failures.keys() - stopped else 1
            why[rank], kinds[rank] = f"exit code {code}: {_last_line(record.line)}", record.kind
            if record.write_error and record.kind != "peer_lost":
                writes[rank] = record.write_error
    for rank, failure in err.failures.items():  # failed before it could write a record
        if rank not in why:
            why[rank] = (f"exit code {failure.exitcode}: {_error_line(failure.message)}"
                         f"{_disk_state(run_dir, 'it left no failure record')}")
            kinds[rank] = "error"
    for rank, name in (killed or {}).items():
        if rank not in stopped and (rank not in why or kinds[rank] == "peer_lost"):
            why[rank], kinds[rank] = f"killed by {name}", "error"
            writes.pop(rank, None)
    causes = {r: w for r, w in why.items() if kinds[r] != "peer_lost"} or why
    if any(w.startswith("killed by") for w in causes.values()):
        # A crash wins: the hang its peers may report is its consequence.
        causes = {r: w for r, w in causes.items() if kinds[r] != "diagnosis"}
    else:
        diagnoses = [records[r].message for r in sorted(causes) if kinds[r] == "diagnosis"]
        if diagnoses:  # the same on every rank that raises it: reported once
            return f"{diagnoses[0]} (logs: {run_dir / 'logs'})"
    return "; ".join(
        f"rank {rank}: {writes[rank]}" if rank in writes
        else f"rank {rank} {text} (log: {run_dir / 'logs' / f'rank{rank}.log'})"
        for rank, text in sorted(causes.items())
    )


def _disk_state(run_dir: Path, what: str = "") -> str:
    """``; <what>: <run dir> has no space left on device`` (or is on a read-only file system),
    or "" when neither: why a rank may have left nothing to read."""
    try:
        stat = os.statvfs(run_dir if run_dir.exists() else run_dir.parent)
    except OSError:
        return ""
    if stat.f_flag & os.ST_RDONLY:
        state = f"is on a {WRITE_ERRORS[errno.EROFS]}"
    elif stat.f_bavail == 0:
        state = f"has {WRITE_ERRORS[errno.ENOSPC]}"
    else:
        return ""
    return f"; {what + ': ' if what else ''}{run_dir} {state}"


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no error message"


def _error_line(message: object) -> str:
    """The exception line of a worker's error record (torch nests it differently by version)."""
    while isinstance(message, dict):
        message = message.get("message", "")
    return _last_line(str(message))
