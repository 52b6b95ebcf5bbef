"""Hang diagnosis through ``python -m app``: the watchdog's one line for each kind of
hang, stacks on demand and comm.debug. The diagnosis itself is tests/unit/test_hangs.py; the
flight recorder for library users, tests/integration/test_hangs.py.

Every app run uses a short ``comm.timeout`` so that a hang costs seconds, and every test that
starts ranks checks that none is left.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.apprun import AppProcess, read_result

TIMEOUT_S = 10  # comm.timeout of the hanging runs: the watchdog diagnoses after 5 s
LOOPS = Path(__file__).parents[1] / "helpers" / "hang_loops.py"
HANG = ("loop=custom", "loop._target_=tests.helpers.hang_loops.Hang")


def site(marker: str) -> str:
    """``hang_loops.py:<line>`` of the line holding ``marker``."""
    for number, line in enumerate(LOOPS.read_text().splitlines(), 1):
        if marker in line:
            return f"hang_loops.py:{number}"
    raise AssertionError(f"no {marker!r} in {LOOPS}")


@pytest.fixture
def app_run(start_app: Callable[..., AppProcess]) -> Callable[..., AppProcess]:
    """``app_run(name, *overrides)`` starts ``python -m app`` (conftest's ``start_app``)."""
    return start_app


def run_hang(app_run: Callable[..., AppProcess], name: str, *overrides: str,
             timeout_s: int = TIMEOUT_S) -> AppProcess:
    """Start a hanging run and wait for its end: within ``timeout_s`` + 15 s of the loop's
    start, exit 2, nothing left running."""
    app = app_run(name, *HANG, f"comm.timeout={timeout_s}", *overrides)
    app.wait_until_training()
    started = time.monotonic()
    code = app.wait()
    took = time.monotonic() - started
    assert took < timeout_s + 15, f"{took:.0f}s from the hang to the end\n{app.describe()}"
    assert code == 2, app.describe()
    app.assert_all_ended()
    return app


# ---- end to end: one line per kind of hang --------------------------------------------------


@pytest.mark.e2e
def test_a_rank_in_user_code(app_run: Callable[..., AppProcess]) -> None:
    app = run_hang(app_run, "sleep", "+loop.fault=sleep")
    assert app.last_line == (
        f"error: hang in INTRA_NODE[0,1,2,3] all_reduce #3 (float32[4], 16 B, {site('everyone')}): "
        f"rank 2 never entered it; rank 2 is in user code at {site('rank sleeps here')} in _sleep "
        f"(its Python stack is in its log) (logs: {app.run_dir / 'logs'})"
    ), app.describe()
    # Every rank's table and stacks are in its log; the sleeping rank's stack shows where it is.
    for rank in range(4):
        assert f"collectives of rank {rank}:" in app.log(rank), app.log(rank)
        assert f"Python stacks of rank {rank}:" in app.log(rank), app.log(rank)
    assert "in _sleep" in app.log(2) and "INTRA_NODE: entered #2, completed #2" in app.log(2)
    assert "all_reduce #3 (float32[4], 16 B, " in app.log(0) and "IN FLIGHT" in app.log(0)


@pytest.mark.e2e
def test_a_rank_that_skips_a_collective(app_run: Callable[..., AppProcess]) -> None:
    app = run_hang(app_run, "skip", "+loop.fault=skip")
    assert app.last_line == (
        f"error: hang in INTRA_NODE[0,1,2,3] all_reduce #3 (float32[4], 16 B, {site('everyone')}): "
        "rank 2 never entered it; rank 2 is in WEIGHT_TRANSFER broadcast #1 (src 0, float32[8], "
        f"32 B, {site('skipper waits')}) (logs: {app.run_dir / 'logs'})"
    ), app.describe()


@pytest.mark.e2e
def test_ranks_that_call_different_collectives(app_run: Callable[..., AppProcess]) -> None:
    app = run_hang(app_run, "mismatch", "+loop.fault=broadcast")
    assert app.last_line == (
        f"error: hang in INTRA_NODE[0,1,2,3] all_reduce #3 (float32[4], 16 B, {site('everyone')}): "
        f"mismatch: rank 2 called broadcast #3 (src 0, float32[4], 16 B, {site('wrong op')}) "
        f"instead (logs: {app.run_dir / 'logs'})"
    ), app.describe()


@pytest.mark.e2e
def test_a_deadlock_across_two_modes(app_run: Callable[..., AppProcess]) -> None:
    app = run_hang(app_run, "deadlock", "+loop.fault=deadlock", "+loop.rank=1")
    assert app.last_line == (
        "error: hang in TRAIN_DATA_PARALLEL[0,1] all_reduce #1 (float32[2], 8 B, "
        f"{site('TDP wait')}): rank 1 never entered it; rank 1 is in INTRA_NODE all_reduce #3 "
        f"(float32[4], 16 B, {site('the partner waits')}) (logs: {app.run_dir / 'logs'})"
    ), app.describe()


@pytest.mark.e2e
def test_shapes_that_differ(app_run: Callable[..., AppProcess]) -> None:
    # Gloo either hangs on a size mismatch (then the mismatch is named) or the rank that receives
    # more than it expects aborts (SIGABRT): the crash path names it and its log holds its
    # Python stack (faulthandler). Which one happens depends on gloo's timing.
    app = run_hang(app_run, "shape", "+loop.fault=shape")
    mismatch = (
        f"error: hang in INTRA_NODE[0,1,2,3] all_reduce #3 (float32[4], 16 B, {site('everyone')}): "
        f"mismatch: rank 2 called all_reduce #3 (float32[8], 32 B, {site('wrong shape')}) "
        f"instead (logs: {app.run_dir / 'logs'})"
    )
    if app.last_line != mismatch:
        crash = re.fullmatch(r"error: rank (\d) killed by SIGABRT \(log: (\S+)\)", app.last_line)
        assert crash, f"neither the mismatch nor a crash:\n{app.describe()}"
        assert "Fatal Python error: Aborted" in Path(crash.group(2)).read_text(), app.describe()


@pytest.mark.e2e
def test_a_killed_rank_is_reported_as_the_crash_it_is(app_run: Callable[..., AppProcess]) -> None:
    # Rank 2 sits in its own code, the others wait for it; then it is killed, before the watchdog
    # (30 s) would diagnose a hang.
    app = app_run("killed", *HANG, "comm.timeout=60", "+loop.fault=sleep")
    app.wait_until_training()
    app.wait_until("rank 2 in its own code", lambda: "in _sleep" in _stack(app, 2))
    app.ranks()[2].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    assert app.wait() == 2, app.describe()
    assert time.monotonic() - killed_at < 30, app.describe()
    assert app.last_line == (
        f"error: rank 2 killed by SIGKILL (log: {app.log_path(2)})"
    ), app.describe()
    app.assert_all_ended()


def _stack(app: AppProcess, rank: int) -> str:
    """Ask the run for stacks (SIGUSR1 to the launcher) and return the rank's log."""
    os.kill(app.pid, signal.SIGUSR1)
    time.sleep(1.0)
    return app.log(rank)


def _last_dump(log: str) -> str:
    """The newest stacks-on-demand dump in a rank's log: every SIGUSR1 appends one (its header
    names the signal; the watchdog's own stack in it shows the line that writes the header)."""
    header = "stacks on demand (SIGUSR1)"
    return log.rpartition(header)[2] if header in log else ""


# ---- stacks on demand, comm.debug, config ---------------------------------------------------


@pytest.mark.e2e
def test_sigusr1_writes_every_ranks_stack_and_table_and_the_run_goes_on(
    app_run: Callable[..., AppProcess],
) -> None:
    # Rank 2 is slow (15 s in its own code), not hung: the others wait for it in all_reduce #3.
    app = app_run("usr1", *HANG, "comm.timeout=60", "+loop.fault=slow", "+loop.max_wait_s=15")
    app.wait_until_training()
    # A rank's table is its own view: all_reduce #2 stays in flight on a rank until the call has
    # returned there, which on a loaded machine can be well after rank 2 has gone on to sleep.
    # So dumps are asked for until every other rank's newest one shows #3 entered.
    app.wait_until("rank 2 asleep and ranks 0, 1, 3 in all_reduce #3",
                   lambda: "in _sleep" in _last_dump(_stack(app, 2))
                   and all("INTRA_NODE: entered #3," in _last_dump(app.log(r))
                           for r in (0, 1, 3)), timeout=60)
    dumps = {rank: _last_dump(app.log(rank)) for rank in (0, 1, 3)}
    assert app.wait() == 0, app.describe()
    assert [r["result"] for r in read_result(app.run_dir)["ranks"]] == [{"steps": 5}] * 4
    for rank, dump in dumps.items():
        assert f"Python stacks of rank {rank}:" in dump and "Thread MainThread" in dump, dump
        assert "INTRA_NODE: entered #3, completed #2" in dump, dump
        assert re.search(r"all_reduce #3 \(float32\[4\], 16 B, \S+hang_loops.py:\d+\) IN FLIGHT",
                         dump), dump
    launcher_log = (app.run_dir.parent / "usr1.stdout").read_text()  # the app's own logger
    assert "SIGUSR1: 4 ranks write their Python stacks" in launcher_log, app.describe()
    app.assert_all_ended()


@pytest.mark.e2e
def test_comm_debug_fails_at_once_on_a_shape_mismatch_naming_both_sides(
    app_run: Callable[..., AppProcess],
) -> None:
    app = app_run("debug", *HANG, "comm.timeout=60", "comm.debug=true", "+loop.fault=shape")
    app.wait_until_training()
    started = time.monotonic()
    assert app.wait() == 2, app.describe()
    assert time.monotonic() - started < 30, app.describe()  # not the 60 s timeout
    assert app.last_line == (
        "error: collective mismatch in INTRA_NODE[0,1,2,3] #3: rank 0 calls all_reduce (float32[4], "
        f"16 B, {site('everyone')}) but rank 2 calls all_reduce (float32[8], 32 B, "
        f"{site('wrong shape')}) (comm.debug) (logs: {app.run_dir / 'logs'})"
    ), app.describe()
    app.assert_all_ended()
