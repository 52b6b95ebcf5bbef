"""Hang diagnosis (issue 11): the flight recorder, the watchdog's one line, stacks on demand and
comm.debug, on real gloo ranks (forked for the library, ``python -m app`` end to end).

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
from typing import Any

import pytest
import torch

from rlcomm.diagnostics.diagnosis import diagnose
from rlcomm.testing import run_ranks
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


# ---- the diagnosis, from progress reports (pure) --------------------------------------------


def _call(mode: str, seq: int, op: str = "all_reduce", shape: tuple[int, ...] = (4,),
          in_flight: bool = True, started: float = 100.0, peer: int | None = None,
          line: int = 7) -> dict[str, Any]:
    return {"mode": mode, "seq": seq, "op": op, "dtype": "float32", "shape": list(shape),
            "nbytes": 4 * int(torch.tensor(shape).prod()), "peer": peer,
            "site": f"train.py:{line}", "path": f"/x/train.py:{line}", "started_wall": started,
            "in_flight": in_flight}


def _report(rank: int, calls: list[dict[str, Any]], where: str = "") -> dict[str, Any]:
    groups = {"GLOBAL": [0, 1, 2, 3], "TRAIN_DATA_PARALLEL": [0, 1], "WEIGHT_TRANSFER": [0, 2]}
    modes: dict[str, Any] = {}
    for call in calls:
        table = modes.setdefault(call["mode"], {"entered": 0, "completed": 0, "calls": []})
        table["entered"] = max(table["entered"], call["seq"])
        table["calls"].append(call)
    return {"rank": rank, "groups": groups, "modes": modes, "where": where}


def _done(mode: str, seq: int) -> dict[str, Any]:
    return _call(mode, seq, in_flight=False, started=1.0)


@pytest.mark.unit
def test_diagnosis_names_a_rank_in_user_code() -> None:
    reports = {r: _report(r, [_done("GLOBAL", 1), _call("GLOBAL", 2, started=100 + r)])
               for r in (0, 1, 3)}
    reports[2] = _report(2, [_done("GLOBAL", 1)], where="train.py:30 in step")
    assert diagnose(reports) == (
        "hang in GLOBAL[0,1,2,3] all_reduce #2 (float32[4], 16 B, train.py:7): rank 2 never "
        "entered it; rank 2 is in user code at train.py:30 in step (its Python stack is in its "
        "log)"
    )


@pytest.mark.unit
def test_diagnosis_names_where_a_missing_rank_is_instead_and_starts_at_the_oldest_call() -> None:
    # Rank 0 waits in TDP for rank 1 (since t=100); rank 1 waits in GLOBAL (since t=102), and so
    # do 2 and 3: the hang started in TDP; GLOBAL is its consequence.
    reports = {
        0: _report(0, [_call("TRAIN_DATA_PARALLEL", 5, shape=(2,), line=9)]),
        1: _report(1, [_done("TRAIN_DATA_PARALLEL", 4), _call("GLOBAL", 3, started=102)]),
        2: _report(2, [_call("GLOBAL", 3, started=101)]),
        3: _report(3, [_call("GLOBAL", 3, started=101)]),
    }
    assert diagnose(reports) == (
        "hang in TRAIN_DATA_PARALLEL[0,1] all_reduce #5 (float32[2], 8 B, train.py:9): rank 1 "
        "never entered it; rank 1 is in GLOBAL all_reduce #3 (float32[4], 16 B, train.py:7)"
    )


@pytest.mark.unit
def test_diagnosis_names_both_sides_of_a_mismatch_and_a_rank_that_did_not_answer() -> None:
    reports: dict[int, Any] = {
        r: _report(r, [_call("GLOBAL", 6, started=100 + r)]) for r in (0, 1)
    }
    reports[2] = _report(2, [_call("GLOBAL", 6, op="broadcast", peer=0, line=12)])
    reports[3] = None
    assert diagnose(reports) == (
        "hang in GLOBAL[0,1,2,3] all_reduce #6 (float32[4], 16 B, train.py:7): mismatch: rank 2 "
        "called broadcast #6 (src 0, float32[4], 16 B, train.py:12) instead; rank 3 did not "
        "answer (process gone or host unreachable)"
    )


@pytest.mark.unit
def test_diagnosis_of_a_collective_everyone_is_in_and_of_no_hang() -> None:
    reports = {r: _report(r, [_call("WEIGHT_TRANSFER", 2, started=100 + r)]) for r in (0, 2)}
    reports.update({r: _report(r, []) for r in (1, 3)})
    assert diagnose(reports).endswith(
        ": ranks [0,2] of 2 are in it with the same arguments and none is missing "
        "(a slow rank or a stalled network?)"
    )
    assert diagnose({r: _report(r, [_done("GLOBAL", 1)]) for r in range(4)}) == ""


# ---- the recorder, on real ranks ------------------------------------------------------------


def _record(rank: int, world_size: int, record: bool) -> dict[str, Any]:
    from rlcomm import CommContext, collectives
    from rlcomm.weights import WeightReceiver, WeightSender

    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60, record=record)
    ctx.init_group([0, 1], "WEIGHT_TRANSFER", backend="gloo")
    try:
        collectives.all_reduce(ctx, "GLOBAL", torch.ones(3))  # all_reduce call
        collectives.broadcast(ctx, "GLOBAL", torch.ones(2, 5, dtype=torch.float64), src=1)
        state = {"w": torch.ones(4)}
        for _ in range(2):
            if rank == 0:
                WeightSender(ctx).send(state) if _ == 0 else None
            else:
                WeightReceiver(ctx).receive() if _ == 0 else None
        table = ctx.recorder.table()
        return {"table": table, "in_flight": len(ctx.recorder.in_flight()),
                "watchdog": ctx.watchdog is not None}
    finally:
        ctx.destroy()


@pytest.mark.integration
def test_the_recorder_keeps_each_modes_calls_with_sequence_numbers_and_callers() -> None:
    out = run_ranks(_record, 2, True, timeout=120)
    this_file = f"{Path(__file__).name}:"
    for rank, got in out.items():
        global_calls = got["table"]["GLOBAL"]["calls"]
        assert [(c["seq"], c["op"], c["dtype"], c["shape"], c["peer"], c["nbytes"])
                for c in global_calls] == [
            (1, "all_reduce", "float32", [3], None, 12),
            (2, "broadcast", "float64", [2, 5], 1, 80),
        ], got
        assert all(c["site"].startswith(this_file) and not c["in_flight"] for c in global_calls)
        assert got["table"]["GLOBAL"]["entered"] == got["table"]["GLOBAL"]["completed"] == 2
        # The first weight transfer: header, metadata, agreement, data, on both sides alike.
        wt = got["table"]["WEIGHT_TRANSFER"]
        assert [c["op"] for c in wt["calls"]] == ["broadcast", "broadcast", "all_reduce",
                                                  "broadcast"], (rank, wt)
        assert all(c["site"].startswith(this_file) for c in wt["calls"]), wt
        assert wt["entered"] == wt["completed"] == 4
        assert got["in_flight"] == 0 and got["watchdog"]


@pytest.mark.integration
def test_recording_off_records_nothing_and_starts_no_watchdog() -> None:
    out = run_ranks(_record, 2, False, timeout=120)
    assert all(got == {"table": {}, "in_flight": 0, "watchdog": False} for got in out.values())


def _hang_in_library(rank: int, world_size: int) -> None:
    from rlcomm import CommContext, collectives

    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=6)
    collectives.all_reduce(ctx, "GLOBAL", torch.ones(1))
    if rank == 1:
        time.sleep(12)  # in user code, past the timeout
    collectives.all_reduce(ctx, "GLOBAL", torch.ones(1))


@pytest.mark.integration
def test_a_library_user_gets_a_hang_error_naming_the_missing_rank() -> None:
    errors = run_ranks(_hang_in_library, 2, expect_failure=True, timeout=60)
    first = errors[0].splitlines()[0]
    assert first.startswith(
        "HangError: hang in GLOBAL[0,1] all_reduce #2 (float32[1], 4 B, test_hangs.py:"
    ), errors
    assert first.endswith(
        "rank 1 never entered it; rank 1 is in user code at test_hangs.py:"
        f"{_line_of('time.sleep(12)')} in _hang_in_library (its Python stack is in its log)"
    ), errors


def _line_of(text: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                if text in line and "_line_of" not in line)


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


# ---- stacks on demand, comm.debug, config ---------------------------------------------------


@pytest.mark.e2e
def test_sigusr1_writes_every_ranks_stack_and_table_and_the_run_goes_on(
    app_run: Callable[..., AppProcess],
) -> None:
    # Rank 2 is slow (10 s in its own code), not hung: the others wait for it in all_reduce #3.
    app = app_run("usr1", *HANG, "comm.timeout=60", "+loop.fault=slow", "+loop.max_wait_s=10")
    app.wait_until_training()
    app.wait_until("every rank's stack",
                   lambda: "in _sleep" in _stack(app, 2)
                   and all("stacks on demand" in app.log(r) for r in range(4)), timeout=60)
    assert app.wait() == 0, app.describe()
    assert [r["result"] for r in read_result(app.run_dir)["ranks"]] == [{"steps": 5}] * 4
    for rank in (0, 1, 3):
        log = app.log(rank)
        assert f"Python stacks of rank {rank}:" in log and "Thread MainThread" in log, log
        assert re.search(r"all_reduce #3 \(float32\[4\], 16 B, \S+hang_loops.py:\d+\) IN FLIGHT",
                         log), log
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
