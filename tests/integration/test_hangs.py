"""Hang diagnosis for library users, on real gloo ranks forked from here: the flight
recorder keeps each mode's calls, recording off records nothing, and a hang is one error naming
the missing rank. The diagnosis itself is tests/unit/test_hangs.py; the app's hangs,
tests/e2e/test_hangs.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlcomm.testing import run_ranks

pytestmark = pytest.mark.integration


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
