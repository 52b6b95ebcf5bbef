"""What ``python -m app.join`` says when its rank fails: a job that ended meanwhile is named as
the cause (its result.json), not the store error it left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.join import failure_line

pytestmark = pytest.mark.unit


def test_a_joiner_whose_job_ended_meanwhile_says_so_in_one_line(tmp_path: Path) -> None:
    err = RuntimeError("Broken pipe")
    assert failure_line(tmp_path, err) == "the joiner failed: RuntimeError: Broken pipe"
    (tmp_path / "result.json").write_text("{}")
    assert failure_line(tmp_path, err) == (
        f"{tmp_path}: the job ended (result.json) while this joiner was joining it "
        "(RuntimeError: Broken pipe)")
