"""rlcomm.elastic on its own, without the app: the example of docs/library.md ("Members that
come and go"), run as it stands: a rank joins a running group of two through the membership,
and a collective then spans all three (real gloo processes on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "docs" / "library.md"


def example() -> str:
    section = PAGE.read_text().split("## Members that come and go", 1)[1]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_the_documented_membership_example_grows_a_group_without_a_restart() -> None:
    code = example()
    assert "run_ranks(grow, 3)" in code and "from rlcomm.elastic import Leader, Member" in code
    exec(compile(code, str(PAGE), "exec"), {"__name__": "library_example"})  # asserts inside
