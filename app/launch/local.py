"""The local launcher (:class:`LocalLauncher`): start ``layout.world_size`` ranks on this machine
through torch's elastic agent (torchrun's engine).

The agent's rendezvous store listens on 127.0.0.1 only, on a port the kernel picks, so two runs
on one machine never collide and nothing is exposed beyond loopback. The ranks are forked from
the app's forkserver (app/launch/forkserver.py), which imported torch and the app once.

A finished run exits promptly, always: a rank that finished but does not exit within
``launcher.shutdown_timeout`` names what holds it in its log and ends itself (exit code 0,
:func:`_exit_guard`); one that cannot (stuck with the interpreter lock held) is named and
killed by the launcher (``DeathWatch``, app/launch/failures.py) twice that long after
``result.json`` appeared, and the run still succeeds.

An elastic rollout rank (``plan.elastic_rollouts``) runs in a child of the process the agent
started, a slot (app/launch/slots.py) that outlives it: a lost rollout rank does not stop the
others, and is started again ``launcher.rollout_restarts`` times.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import uuid
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

from app.errors import LaunchInterruptedError, RankFailedError
from app.launch import forkserver, slots
from app.launch.failures import (
    DeathWatch,
    describe_failures,
    disk_state,
    drop_unreadable_error_file,
    last_line,
    write_error_line,
)
from app.launch.lifeline import tie_to_launcher
from app.launch.private import (
    AgentRestartNotice,
    NoWorkerTraceback,
    name_agent_host,
    started_processes,
)
from app.launch.rank import run_rank
from app.output.logs import console_handler
from rlcomm import LayoutPlan

if TYPE_CHECKING:
    from app.api import RankEnv
    from app.launch.planning import ValidatedJob

LOOPBACK = "127.0.0.1"
# What the agent turns into SignalException (TORCHELASTIC_SIGNALS_TO_HANDLE's default).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
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
            # The store serves on the descriptor and closes it when it goes. The socket object
            # lets go of it: closed twice, the second close would hit whatever took the number
            # in between (the picture thread's font file: EBADF drawing layout.png).
            self._listener.detach()
        store = PrefixStore(self.run_id, self._store)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(LOOPBACK, self.master_port))

    def shutdown(self) -> bool:
        self._store = None  # it closes the listening descriptor (next_rendezvous)
        return True


def _create_handler(params: RendezvousParameters) -> LoopbackRendezvous:
    return LoopbackRendezvous(LOOPBACK, 0, 0, 1, params.run_id, int(params.get("timeout", 600)))


class LocalLauncher:
    """Starts every rank on this machine and waits for them (the
    :class:`app.launch.launcher.Launcher` contract): ``python -m app`` outside any launcher."""

    name = "local"
    starts_ranks = True

    def claims(self, env: RankEnv, engine: str) -> bool:
        return not env.joins and engine == "local"

    def launch(self, job: ValidatedJob, plan: LayoutPlan, run_dir: Path) -> dict[str, Any]:
        logging.getLogger("app").info("starting %d local ranks; run dir %s", plan.world_size,
                                      run_dir)
        return launch_local(job, plan, run_dir)


def launch_local(job: ValidatedJob, plan: LayoutPlan, run_dir: Path) -> dict[str, Any]:
    """Run every rank locally; returns rank 0's summary or raises RankFailedError. ``job``, its
    loop built and checked and the run's shape derived (app/launch/planning.py), travels to
    every rank as it is."""
    rendezvous_handler_registry.register(_BACKEND, _create_handler)  # the same creator: a no-op
    _quiet_agent()
    # Every rank is on this host: the agent need not look its name up (socket.getfqdn's DNS
    # query, unbounded where the resolver is slow) between the last rank's exit and ours.
    name_agent_host(socket.gethostname())
    launch = _launch_config(job, plan, run_dir)
    deaths = DeathWatch(run_dir / "logs", plan.world_size, result=run_dir / "result.json",
                        exit_bound_s=2 * float(job.launcher.shutdown_timeout),
                        log=launcher_log())
    previous = signal.signal(signal.SIGUSR1,
                             lambda *_: _forward_to_ranks(signal.SIGUSR1, run_dir, deaths))
    stops = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
    before = set(started_processes())
    try:
        return _run_agent(launch, job, plan, run_dir, deaths)
    except SignalException as err:  # the agent forwarded the signal to the ranks it knew of
        for stop in _STOP_SIGNALS:  # one stop at a time: a repeated signal must not cut it short
            signal.signal(stop, signal.SIG_IGN)
        _stop_survivors(before, err.sigval, float(job.launcher.shutdown_timeout))
        name = signal.Signals(err.sigval).name
        raise LaunchInterruptedError(
            f"interrupted by {name}: stopped all {plan.world_size} ranks "
            f"(logs: {run_dir / 'logs'})",
            int(err.sigval),
        ) from None
    finally:
        deaths.stop()
        signal.signal(signal.SIGUSR1, previous)
        for stop, handler in stops.items():  # the agent's handler raises; it ends with the run
            if handler is not None:  # None: not set from Python, nothing to put back
                signal.signal(stop, handler)


def _run_agent(launch: LaunchConfig, job: ValidatedJob, plan: LayoutPlan, run_dir: Path,
               deaths: DeathWatch) -> dict[str, Any]:
    """The agent's run of every rank; rank 0's summary, or RankFailedError. A signal (the
    agent's SignalException) may land anywhere in here, the failure's description included."""
    try:
        # The launcher's environment travels with the ranks: a forked rank adopts it.
        elastic_launch(launch, _local_rank)(job, plan, str(run_dir), dict(os.environ))
    except ChildFailedError as err:
        if not deaths.only_stragglers_failed():
            raise RankFailedError(describe_failures(err, run_dir, deaths.killed(),
                                                      deaths.signalled())) from None
        # Every rank finished; the ones that would not exit were named and killed.
    # Rank 0 reports through result.json (JSON), not through the agent's pickled return values.
    return read_result(run_dir)


def _stop_survivors(before: set[BaseProcess], signum: int, grace_s: float) -> None:
    """Stops every process the agent started that is still running once it gave up: ``signum``,
    then SIGKILL ``grace_s`` later, as the agent stops its ranks. A signal that lands while the
    agent starts them (before it holds them: torch 2.13's MultiprocessContext) leaves ranks it
    never stops, which would train on unseen and hold the launcher's exit (multiprocessing joins
    its children) for ever."""
    survivors = [p for p in started_processes() if p not in before and p.is_alive()]
    for pid in (p.pid for p in survivors):
        if pid is not None:  # started: it has one
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
    deadline = time.monotonic() + grace_s
    for proc in survivors:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in survivors:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def _quiet_agent() -> None:
    """The agent's console lines: warnings, and a restart notice above rank 0's progress bar;
    a failed rank's traceback stays in its log file."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    worker_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, NoWorkerTraceback) for f in worker_log.filters):
        worker_log.addFilter(NoWorkerTraceback())
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent_log.setLevel(logging.INFO)
    if not any(isinstance(f, AgentRestartNotice) for f in agent_log.filters):
        agent_log.addFilter(AgentRestartNotice())
        # The agent speaks while rank 0's progress bar is on the same terminal: above it.
        agent_log.addHandler(console_handler("launcher"))
        agent_log.propagate = False


def _launch_config(job: ValidatedJob, plan: LayoutPlan, run_dir: Path) -> LaunchConfig:
    """The agent's settings: one node, ``plan.world_size`` ranks, the loopback rendezvous."""
    # Started at the app's first line already (python -m app); here for any other way in.
    start_method = forkserver.START_METHOD if forkserver.start() else "spawn"
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=plan.world_size,
        run_id=f"rlcomm-{uuid.uuid4().hex[:8]}",
        rdzv_backend=_BACKEND,
        rdzv_endpoint=f"{LOOPBACK}:0",
        rdzv_configs={"timeout": int(job.comm.timeout)},
        max_restarts=job.launcher.max_restarts,
        monitor_interval=job.launcher.monitor_interval,
        start_method=start_method,
        local_addr=LOOPBACK,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs" / "elastic")),
    )
    launch.shutdown_timeout = job.launcher.shutdown_timeout  # type: ignore[assignment]  # seconds, as the agent's float wait
    return launch


def read_result(run_dir: Path) -> dict[str, Any]:
    """Rank 0's ``result.json``; a missing or unreadable one (a write that failed) is one line."""
    path = run_dir / "result.json"
    try:
        summary: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        why = write_error_line(err) if isinstance(err, OSError) else None
        if why is None:
            why = "it is missing" if isinstance(err, FileNotFoundError) else (
                f"it is not JSON ({type(err).__name__}: {last_line(str(err))})"
            )
        raise RankFailedError(
            f"the ranks ended, but rank 0's summary {path} cannot be read: {why}"
            f"{disk_state(run_dir)}"
        ) from None
    return summary


def _local_rank(job: ValidatedJob, plan: LayoutPlan, run_dir: str,
                launcher_env: dict[str, str]) -> None:
    forkserver.adopt_launcher_environment(launcher_env)
    rank = int(os.environ.get("RANK", "-1"))
    if plan.is_elastic_rank(rank):
        # A lost elastic rank must not end this process: the agent would stop every rank.
        if slots.can_fork():
            tie_to_launcher(launched_here=True)  # the slot as a rank is: its child is tied to it
            setting = "rollout_restarts" if rank in plan.rollouts else "trainer_restarts"
            slots.supervise(rank,
                            lambda _incarnation: run_rank_here(job, plan, run_dir),
                            getattr(job.launcher, setting), Path(run_dir), launcher_log(),
                            f"launcher.{setting}")
            return
        launcher_log().warning("rank %d: its process runs other threads and cannot fork a "
                                "rank it survives; losing this rank fails the run", rank)
    run_rank_here(job, plan, run_dir)


def run_rank_here(job: ValidatedJob, plan: LayoutPlan, run_dir: str) -> None:
    """The rank, in this process: the agent's worker process, a slot's child
    (app/launch/slots.py), or a Ray actor's child (app/launch/ray_rank.py)."""
    forkserver.set_process_name(f"rlcomm-rank{os.environ.get('RANK', '')}")  # ps, top
    try:
        run_rank(job, plan, run_dir, launched_here=True)
    except Exception:
        if drop_unreadable_error_file():
            # Re-raised, the exception would make torch write the error file again, on the
            # same full disk: the agent would then fail reading it (JSONDecodeError). The
            # rank's own failure record, written into room kept for it, says what failed.
            sys.exit(1)
        raise
    grace = float(job.launcher.shutdown_timeout)
    _exit_guard(Path(run_dir) / "result.json", grace, float(job.comm.timeout) + grace)


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


def launcher_log() -> logging.Logger:
    """``[launcher] ...`` lines on the console, above any progress bar."""
    log = logging.getLogger("rlcomm.launcher")
    if not log.handlers:
        log.addHandler(console_handler("launcher"))
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
