"""A slot (app/launch/slots.py) survives its elastic rollout rank: restarts a lost one, fails the
run on the rank's own error, forwards signals, and leaves no process behind. Real forked
processes, no distributed runtime: each test runs :func:`supervise` in a forked "slot" process
with a small child function standing in for the rank."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from app.launch.failures import recording_failures
from app.launch.lifeline import tie_to_launcher
from app.launch.slots import INCARNATION_VARIABLE, can_fork, supervise
from rlcomm.errors import PeerLostError

pytestmark = pytest.mark.integration

RANK = 3
DONE_S = 30.0  # generous: a loaded 2-core machine


def _slot_main(run_dir: Path, run_child: Callable[[int], None], restarts: int) -> None:
    log = logging.getLogger(f"test-slot-{os.getpid()}")
    handler = logging.FileHandler(run_dir / "slot.log")
    handler.setFormatter(logging.Formatter("[launcher] %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    (run_dir / "slot.pid").write_text(str(os.getpid()))
    supervise(RANK, run_child, restarts, run_dir, log)
    # Only a finished rank returns: a stopped slot must not go back into the agent's wrapper,
    # which would wait for the whole group.
    (run_dir / "returned").touch()


def _start_slot(run_dir: Path, run_child: Callable[[int], None],
                restarts: int = 0) -> multiprocessing.process.BaseProcess:
    slot = multiprocessing.get_context("fork").Process(
        target=_slot_main, args=(run_dir, run_child, restarts))
    slot.start()
    return slot


def _note_pid(run_dir: Path, incarnation: int) -> None:
    """What every child does first: its pid and incarnation, for the test to read."""
    # A rank starts with SIGTERM's default action; this child was forked from pytest, whose
    # earlier tests may have left a handler (torch's elastic launcher installs one).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    tie_to_launcher(launched_here=True)  # as run_rank does: the slot is accepted as its parent
    env = os.environ.get(INCARNATION_VARIABLE, "")
    # Written aside and renamed: the test reads it as soon as it appears.
    partial = run_dir / f"child{incarnation}.pid.tmp"
    partial.write_text(f"{os.getpid()} {env}")
    partial.rename(run_dir / f"child{incarnation}.pid")


def _child_pids(run_dir: Path) -> list[int]:
    return [int(p.read_text().split()[0]) for p in sorted(run_dir.glob("child*.pid"))]


def _wait_for(path: Path, timeout_s: float = DONE_S) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} did not appear"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _all_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], "processes left behind"


def _finish(slot: multiprocessing.process.BaseProcess, run_dir: Path) -> int | None:
    slot.join(DONE_S)
    if slot.is_alive():
        slot.kill()
        slot.join(5)
        pytest.fail("the slot did not end")
    _all_gone([slot.pid or 0, *_child_pids(run_dir)])
    return slot.exitcode


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


# The children: module-level so that each test's is plain to read.

def _succeeds(run_dir: Path) -> Callable[[int], None]:
    def child(incarnation: int) -> None:
        _note_pid(run_dir, incarnation)
    return child


def _killed_first(run_dir: Path) -> Callable[[int], None]:
    def child(incarnation: int) -> None:
        _note_pid(run_dir, incarnation)
        if incarnation == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    return child


def _raises(run_dir: Path, error: Exception, times: int = 99) -> Callable[[int], None]:
    def child(incarnation: int) -> None:
        _note_pid(run_dir, incarnation)
        if incarnation < times:
            with recording_failures(run_dir / "logs", RANK, 0, "here"):
                raise error
    return child


def _sleeps(run_dir: Path) -> Callable[[int], None]:
    def child(incarnation: int) -> None:
        def dump(*_: object) -> None:
            (run_dir / "usr1").write_text("stacks")
        signal.signal(signal.SIGUSR1, dump)
        _note_pid(run_dir, incarnation)
        time.sleep(DONE_S * 2)
    return child


def test_a_finished_rank_ends_its_slot(tmp_path: Path) -> None:
    slot = _start_slot(tmp_path, _succeeds(tmp_path))
    assert _finish(slot, tmp_path) == 0
    assert len(_child_pids(tmp_path)) == 1
    assert (tmp_path / "child0.pid").read_text().split()[1:] == []  # no incarnation: the first
    assert (tmp_path / "returned").exists()
    assert not (tmp_path / "slot.log").read_text()


def test_a_killed_rank_is_started_again(tmp_path: Path) -> None:
    slot = _start_slot(tmp_path, _killed_first(tmp_path), restarts=1)
    assert _finish(slot, tmp_path) == 0
    first, _ = _child_pids(tmp_path)
    assert (tmp_path / "child1.pid").read_text().split()[1] == "1"  # RLCOMM_INCARNATION=1
    line = (f"[launcher] rank {RANK} (pid {first}) was killed by SIGKILL; starting it again "
            "(restart 1 of 1)")
    assert (tmp_path / "slot.log").read_text().splitlines() == [line]
    assert line.removeprefix("[launcher] ") in (tmp_path / "logs" / f"rank{RANK}.log").read_text()
    assert (tmp_path / "returned").exists()


def test_a_lost_rank_without_restarts_waits_for_the_run_to_end(tmp_path: Path) -> None:
    slot = _start_slot(tmp_path, _killed_first(tmp_path), restarts=0)
    _wait_for(tmp_path / "child0.pid")
    _wait_for(tmp_path / "slot.log")  # created by the test's handler before the child started
    end = time.monotonic() + DONE_S
    while "not restarted" not in (tmp_path / "slot.log").read_text():
        assert time.monotonic() < end, "the loss was not logged"
        time.sleep(0.02)
    time.sleep(0.5)
    assert slot.is_alive()  # the run goes on without it: the slot stays until it ends
    (tmp_path / "result.json").write_text("{}")
    assert _finish(slot, tmp_path) == 0
    (pid,) = _child_pids(tmp_path)
    assert (tmp_path / "slot.log").read_text().splitlines() == [
        f"[launcher] rank {RANK} (pid {pid}) was killed by SIGKILL; not restarted "
        "(launcher.rollout_restarts=0)"]
    assert (tmp_path / "returned").exists()


def test_a_slot_without_its_rank_ends_when_stopped(tmp_path: Path) -> None:
    slot = _start_slot(tmp_path, _killed_first(tmp_path), restarts=0)
    _wait_for(tmp_path / "child0.pid")
    end = time.monotonic() + DONE_S
    while "not restarted" not in (tmp_path / "slot.log").read_text():
        assert time.monotonic() < end, "the loss was not logged"
        time.sleep(0.02)
    assert slot.pid is not None
    os.kill(slot.pid, signal.SIGTERM)  # the agent stops the group: the run failed elsewhere
    assert _finish(slot, tmp_path) == 0
    assert not (tmp_path / "returned").exists()


def test_a_stop_found_beside_the_rank_s_death_ends_the_slot_as_stopped(tmp_path: Path) -> None:
    """The rank was killed and the agent stopped the group (a peer failed over the loss) before
    the slot looked: both signals pending, SIGTERM taken first. The slot must end as stopped
    (exit 0), not as its dead rank (SIGKILL), which would name the loss as the run's cause."""
    slot = _start_slot(tmp_path, _sleeps(tmp_path), restarts=0)
    _wait_for(tmp_path / "child0.pid")
    (child,) = _child_pids(tmp_path)
    assert slot.pid is not None
    os.kill(slot.pid, signal.SIGSTOP)  # a busy machine: the slot does not run for a while
    try:
        os.kill(child, signal.SIGKILL)
        end = time.monotonic() + DONE_S
        while _alive(child):  # dead, a zombie until the slot reaps it
            assert time.monotonic() < end, "the rank did not die"
            time.sleep(0.02)
        os.kill(slot.pid, signal.SIGTERM)
    finally:
        os.kill(slot.pid, signal.SIGCONT)
    assert _finish(slot, tmp_path) == 0
    assert not (tmp_path / "returned").exists()


def test_a_rank_that_raises_fails_the_run(tmp_path: Path) -> None:
    slot = _start_slot(tmp_path, _raises(tmp_path, ValueError("a bug")), restarts=2)
    assert _finish(slot, tmp_path) == 1
    assert len(_child_pids(tmp_path)) == 1  # not restarted: a bug is not a lost worker
    assert not (tmp_path / "slot.log").read_text()
    assert not (tmp_path / "returned").exists()


def test_a_rank_that_lost_a_peer_is_lost_too(tmp_path: Path) -> None:
    error = PeerLostError("rank 3: lost rank 0")
    slot = _start_slot(tmp_path, _raises(tmp_path, error, times=1), restarts=1)
    assert _finish(slot, tmp_path) == 0
    first, _ = _child_pids(tmp_path)
    assert (tmp_path / "slot.log").read_text().splitlines() == [
        f"[launcher] rank {RANK} (pid {first}) exited with code 1 (PeerLostError: rank 3: lost "
        "rank 0); starting it again (restart 1 of 1)"]


def test_signals_reach_the_rank_and_sigterm_ends_both(tmp_path: Path) -> None:
    slot = _start_slot(tmp_path, _sleeps(tmp_path))
    _wait_for(tmp_path / "child0.pid")
    (child,) = _child_pids(tmp_path)
    assert slot.pid is not None
    assert (_comm(slot.pid), _comm(child)) == (f"rlcomm-slot{RANK}", f"rlcomm-rank{RANK}")
    os.kill(slot.pid, signal.SIGUSR1)  # the launcher's request for stack dumps
    _wait_for(tmp_path / "usr1")
    assert slot.is_alive()
    os.kill(slot.pid, signal.SIGTERM)  # the agent stops the slot: it ends as its rank did
    assert _finish(slot, tmp_path) == -signal.SIGTERM
    assert not (tmp_path / "returned").exists()


def test_a_killed_slot_takes_its_rank_along(tmp_path: Path) -> None:
    slot = _start_slot(tmp_path, _sleeps(tmp_path), restarts=5)
    _wait_for(tmp_path / "child0.pid")
    assert slot.pid is not None
    os.kill(slot.pid, signal.SIGKILL)  # the agent, after launcher.shutdown_timeout
    assert _finish(slot, tmp_path) == -signal.SIGKILL


def test_the_launchers_death_watch_knows_the_slot_as_its_rank(tmp_path: Path) -> None:
    from app.launch.failures import DeathWatch

    slot = _start_slot(tmp_path, _sleeps(tmp_path))
    _wait_for(tmp_path / "child0.pid")
    watch = DeathWatch(tmp_path / "logs", 1, period_s=60)
    try:
        assert slot.pid is not None
        assert watch._rank_of(slot.pid) == RANK
    finally:
        watch.stop()
        os.kill(slot.pid or 0, signal.SIGTERM)
    assert _finish(slot, tmp_path) == -signal.SIGTERM


def test_a_process_with_threads_does_not_fork_a_rank() -> None:
    import threading

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not can_fork()
    finally:
        stop.set()
        thread.join()
