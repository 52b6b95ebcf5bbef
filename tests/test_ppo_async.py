"""Asynchronous rollout with bounded staleness, through the app on real processes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.lockstep_trajectory import FIXTURE, trajectory


def test_lockstep_reproduces_the_recorded_trajectory_to_the_bit(tmp_path: Path) -> None:
    recorded = json.loads(FIXTURE.read_text())
    now = trajectory(tmp_path, "loop.max_staleness=0")
    assert now["updates"] == recorded["updates"]
    assert now["param_checksum"] == recorded["param_checksum"]
