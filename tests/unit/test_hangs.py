"""Hang diagnosis, pure: what the diagnosis says from the ranks' progress reports
(rlcomm/diagnostics/diagnosis.py). The flight recorder on real ranks is
tests/integration/test_hangs.py; each kind of hang through ``python -m app``,
tests/e2e/test_hangs.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlcomm.diagnostics.diagnosis import diagnose

pytestmark = pytest.mark.unit


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


def test_diagnosis_names_a_rank_in_user_code() -> None:
    reports = {r: _report(r, [_done("GLOBAL", 1), _call("GLOBAL", 2, started=100 + r)])
               for r in (0, 1, 3)}
    reports[2] = _report(2, [_done("GLOBAL", 1)], where="train.py:30 in step")
    assert diagnose(reports) == (
        "hang in GLOBAL[0,1,2,3] all_reduce #2 (float32[4], 16 B, train.py:7): rank 2 never "
        "entered it; rank 2 is in user code at train.py:30 in step (its Python stack is in its "
        "log)"
    )


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


def test_diagnosis_of_a_collective_everyone_is_in_and_of_no_hang() -> None:
    reports = {r: _report(r, [_call("WEIGHT_TRANSFER", 2, started=100 + r)]) for r in (0, 2)}
    reports.update({r: _report(r, []) for r in (1, 3)})
    assert diagnose(reports).endswith(
        ": ranks [0,2] of 2 are in it with the same arguments and none is missing "
        "(a slow rank or a stalled network?)"
    )
    assert diagnose({r: _report(r, [_done("GLOBAL", 1)]) for r in range(4)}) == ""
