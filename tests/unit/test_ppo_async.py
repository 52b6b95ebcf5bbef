"""Asynchronous rollout with bounded staleness, in this process: the lockstep comparison lets
CPU rounding through but not a changed update, and data older than the bound is an error. The
runs through the app are tests/e2e/test_ppo_async.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.loops.ppo import StaleDataError, check_staleness
from tests.helpers.lockstep_trajectory import FIXTURE, REL_TOL, deviations

pytestmark = pytest.mark.unit


def test_the_lockstep_comparison_lets_rounding_through_but_not_a_changed_update() -> None:
    recorded = json.loads(FIXTURE.read_text())

    def scaled(factor: float, update: int | None = None, key: str | None = None) -> dict[str, Any]:
        """The recording with values scaled by ``factor`` (all, or one update's ``key``)."""
        copy = json.loads(json.dumps(recorded))
        for i, row in enumerate(copy["updates"]):
            for k in row:
                if update is None or (i, k) == (update, key):
                    row[k] = (float.fromhex(row[k]) * factor).hex()
        if update is None:
            copy["param_checksum"] = {r: (float.fromhex(v) * factor).hex()
                                      for r, v in copy["param_checksum"].items()}
        return copy

    assert deviations(recorded, recorded) == []
    assert deviations(scaled(1 + 1e-4), recorded) == []  # the most another CPU strays
    off = deviations(scaled(1 + 1e-2, update=2, key="v_loss"), recorded)  # a changed update
    assert len(off) == 1 and off[0].startswith("update 3 v_loss: "), off
    assert off[0].endswith(f"recorded (1.0e-02 relative > {REL_TOL:g})"), off
    assert len(deviations(scaled(1 - 1e-2), recorded)) == 6 * 6 + 4  # every value, every rank
    shorter = {**recorded, "updates": recorded["updates"][:5]}
    assert deviations(shorter, recorded) == ["updates: 5 now, 6 recorded"]


def test_data_older_than_the_bound_is_an_error_never_trained_on() -> None:
    assert check_staleness([(2, 7), (3, 6)], current=7, max_staleness=1, update=9) == [0, 1]
    with pytest.raises(StaleDataError, match=r"update 9: rank 3's segment was collected with "
                       r"weights version 5, 2 behind version 7 \(loop.max_staleness=1\)"):
        check_staleness([(2, 7), (3, 5)], current=7, max_staleness=1, update=9)
    with pytest.raises(StaleDataError, match="-1 behind"):  # from the future: a protocol bug
        check_staleness([(2, 8)], current=7, max_staleness=3, update=9)
