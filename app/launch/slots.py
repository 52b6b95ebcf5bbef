"""A slot: the process the elastic agent starts for an elastic rank (a rollout rank, or a trainer
other than the lead), which survives its rank (``launcher.rollout_restarts``,
``launcher.trainer_restarts``: ``setting``).

torch's elastic agent stops every rank (and fails the run, or restarts all of them) as soon as
one of its worker processes exits non-zero. With elastic rollouts (``plan.elastic_rollouts``) a
lost rollout rank is dropped by its trainers and the run goes on, so under the local launcher
the agent's worker process for such a rank does not run the rank: it forks a child that does
(:func:`supervise`) and stays, named ``rlcomm-slot<N>``, while the child is ``rlcomm-rank<N>``.

- The child exits 0: the slot returns (the rank finished).
- The child raised and left a failure record (app/launch/failures.py) of any kind but
  ``peer_lost``: a bug, not a lost worker; the slot exits with the child's exit code, and the
  run fails as it does without a slot.
- Otherwise (a signal killed it, or it exited non-zero with no record or a ``peer_lost`` one)
  the rank is *lost*: the slot says so on the console and starts it again, with
  ``RLCOMM_INCARNATION=<k>`` (k = 1, 2, ...) in its environment, while restarts are left; then it
  waits, idle, until the run ends (``result.json``: it returns) or the agent stops it (exit 0).

Signals: SIGTERM and SIGINT from the agent are forwarded to the child, and the slot then exits as
the child did (a stop that finds the child already lost ends the slot with exit 0: the loss was not
the run's cause); SIGUSR1 (the launcher's request for stack dumps) is forwarded. A SIGINT from the
terminal (Ctrl-C) reached the child already and is not sent twice. The child dies with the slot
(app/launch/lifeline.py): a slot SIGKILLed after ``launcher.shutdown_timeout`` leaves nothing.

The slot holds the rank's log file open, so the launcher's DeathWatch (app/launch/failures.py), which
knows rank processes by that file, sees it as the rank; it also appends its own lines there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import multiprocessing.process
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NoReturn

from app.launch import forkserver
from app.launch.failures import FailureRecord, record_path
from app.launch.lifeline import die_with_parent

INCARNATION_VARIABLE = "RLCOMM_INCARNATION"  # in a restarted rank: which start it is (1, 2, ...)
POLL_S = 0.2  # how often an idle slot looks for the run's end (it sleeps in between)
NAP_S = 0.02  # how soon a slot sees a signal it waits for (it polls: see next_signal)

_STOPS = frozenset({signal.SIGTERM, signal.SIGINT})
_FORWARDED = _STOPS | {signal.SIGUSR1}
_WAKES = _FORWARDED | {signal.SIGCHLD}
_SI_KERNEL = 0x80  # <asm-generic/siginfo.h>: sent by the kernel (a terminal's Ctrl-C)


def can_fork() -> bool:
    """Whether this process may fork a child that runs Python: it holds no other thread (none
    that Python knows of, and, where /proc tells, none at all)."""
    if threading.active_count() != 1:
        return False
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/self/task")) == 1
    return True


def supervise(rank: int, run_child: Callable[[int], None], restarts: int, run_dir: Path,
              log: logging.Logger, setting: str = "launcher.rollout_restarts") -> None:
    """Runs ``run_child(k)`` in a forked child, the rank's k-th start (0 first), and starts it
    again while it is lost and restarts are left. Returns once the rank finished: its child
    exited 0, or it was lost for good and the run finished without it (``result.json``).
    Otherwise ends this process, never to return into the agent's worker wrapper (which would
    wait for the whole group): with the child's exit code when the rank failed on its own error,
    and, when the agent stopped this slot (SIGTERM, SIGINT), as the child ended (0 without
    one). Call it only where :func:`can_fork`."""
    run_dir = Path(run_dir)
    log_dir, result = run_dir / "logs", run_dir / "result.json"
    forkserver.set_process_name(f"rlcomm-slot{rank}")
    log_dir.mkdir(parents=True, exist_ok=True)
    reaping = signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # not SIG_IGN: children are waited for
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WAKES)
    rank_log = (log_dir / f"rank{rank}.log").open("a")  # held open to the end
    try:
        incarnation = 0
        while True:
            started = time.time()
            child = _start(rank, run_child, incarnation, mask, rank_log)
            status, stopped = _wait(child)
            pid = child.pid or 0
            child.close()
            if stopped:
                _end(status)
            if status == 0:
                return
            record = _record_of(log_dir, rank, pid, started)
            if failed_on_its_own(status, record):
                _end(status)  # the rank's own error: the run fails as it would without a slot
            if _take_stop():
                _end(0)
            what = f"rank {rank} (pid {pid}) {_describe(status, record)}"
            if incarnation < restarts:
                incarnation += 1
                _say(log, rank_log, f"{what}; starting it again "
                                    f"(restart {incarnation} of {restarts})")
                continue
            _say(log, rank_log, f"{what}; not restarted ({setting}={restarts})")
            if not _wait_for_end(result):
                _end(0)
            return
    finally:
        rank_log.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if reaping is not None:
            signal.signal(signal.SIGCHLD, reaping)


def _end(status: int) -> NoReturn:
    """Ends this process: exit code ``status``, or killed by signal ``-status``. Not by
    returning (nor by ``sys.exit(0)``, which torch's ``record`` turns into a return)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if status > 0:
        sys.exit(status)
    if status < 0:
        signum = -status
        with contextlib.suppress(ValueError, OSError):  # SIGKILL's cannot be set: it kills anyway
            signal.signal(signum, signal.SIG_DFL)
        with contextlib.suppress(ValueError, OSError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
            os.kill(os.getpid(), signum)
    os._exit(0 if status == 0 else 128 - status)  # a signal that did not end this process


def _start(rank: int, run_child: Callable[[int], None], incarnation: int,
           mask: set[int | signal.Signals], rank_log: IO[str]) -> multiprocessing.process.BaseProcess:
    ctx = multiprocessing.get_context("fork")
    # A forked child's multiprocessing parent is this slot: app/launch/lifeline.py ties it here.
    child = ctx.Process(target=_child_main, name=f"rlcomm-rank{rank}",
                        args=(rank, run_child, incarnation, os.getpid(), mask, rank_log))
    child.start()
    return child


def _child_main(rank: int, run_child: Callable[[int], None], incarnation: int, slot: int,
                mask: set[int | signal.Signals], rank_log: IO[str]) -> None:
    die_with_parent()
    if os.getppid() != slot:  # the slot died before the request
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as run_rank does first: until it listens
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    with contextlib.suppress(OSError):
        rank_log.close()
    forkserver.set_process_name(f"rlcomm-rank{rank}")
    if incarnation:
        os.environ[INCARNATION_VARIABLE] = str(incarnation)
    else:
        os.environ.pop(INCARNATION_VARIABLE, None)
    # Exit codes as torch's worker wrapper gives a rank without a slot: its traceback is in
    # its log (run_rank), the console gets the launcher's one line.
    try:
        run_child(incarnation)
    except KeyboardInterrupt:
        pass
    except Exception:
        sys.exit(1)


def _wait(child: multiprocessing.process.BaseProcess) -> tuple[int, bool]:
    """The child's exit code (minus the signal that killed it), and whether this slot was told
    to stop meanwhile (SIGTERM, SIGINT: forwarded)."""
    stopped = False
    while True:
        code = child.exitcode  # reaps it once it ended
        if code is not None:
            return code, stopped
        info = next_signal(_WAKES, POLL_S)
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        signum = info.si_signo
        ended = child.exitcode if signum in _STOPS else None
        if ended is not None:
            # The child ended before the stop came (a busy slot finds both pending, and takes
            # SIGTERM before SIGCHLD). A lost child's end is judged as any other, the stop left
            # pending for _take_stop: passed on as the slot's end, it would make a loss the
            # run's cause.
            if ended != 0:
                signal.pthread_kill(threading.get_ident(), signum)
            return ended, stopped or ended == 0
        if not (signum == signal.SIGINT and info.si_code == _SI_KERNEL):  # Ctrl-C: got it too
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid or 0, signum)
        stopped = stopped or signum in _STOPS


def _wait_for_end(result: Path) -> bool:
    """Until the run finished (``result``: True) or the agent stops this slot (False); asleep
    meanwhile."""
    while not result.exists():
        info = next_signal(_WAKES, POLL_S)
        if info is not None and info.si_signo in _STOPS:
            return False
    return True


def next_signal(wanted: frozenset[signal.Signals], timeout_s: float) -> Any:
    """The ``signal.struct_siginfo`` of the next of ``wanted`` (blocked in this thread) that
    arrives within ``timeout_s``, or None. It polls, never blocking in ``sigtimedwait``: a wait
    that a stop and continue (SIGSTOP or Ctrl-Z, then SIGCONT) interrupts past its deadline
    returns an unfilled siginfo in CPython 3.11 (garbage, or EINVAL), which would forward a
    signal nobody sent."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = signal.sigtimedwait(wanted, 0)
        left = deadline - time.monotonic()
        if info is not None or left <= 0:
            return info
        time.sleep(min(left, NAP_S))


def _take_stop() -> bool:
    """Whether the agent asked this slot to stop while no child ran (the request is taken)."""
    if not signal.sigpending() & _STOPS:
        return False
    return signal.sigtimedwait(_STOPS, 0) is not None


def failed_on_its_own(status: int, record: FailureRecord | None) -> bool:
    """Whether a rank process that ended with ``status``, leaving ``record``, failed on its own
    error (a bug no new process would fix) rather than being lost: it exited non-zero with a
    failure record other than a lost peer's. The Ray engine's driver asks the same."""
    return status > 0 and record is not None and record.kind != "peer_lost"


def _record_of(log_dir: Path, rank: int, pid: int, since: float) -> FailureRecord | None:
    """The failure record the child ``pid`` left, if any (not one of an earlier process)."""
    try:
        record = FailureRecord(**json.loads(record_path(log_dir, rank).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return record if record.pid == pid and record.time >= since - 1.0 else None


def _describe(status: int, record: FailureRecord | None) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    if record is None:
        return f"exited with code {status} and left no failure record"
    lines = record.line.strip().splitlines()
    return f"exited with code {status} ({lines[-1] if lines else record.error})"


def _say(log: logging.Logger, rank_log: IO[str], line: str) -> None:
    """``line`` on the launcher's console and in the rank's log."""
    log.warning("%s", line)
    with contextlib.suppress(OSError, ValueError):
        rank_log.write(f"{time.strftime('%H:%M:%S')} [launcher] WARNING {__name__}: {line}\n")
        rank_log.flush()
