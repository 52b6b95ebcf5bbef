"""tests/conftest.py's rules, on a throwaway test suite run by a real pytest: every test has one
tier, and no test module imports another."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CONFTEST = Path(__file__).parents[1] / "conftest.py"
INI = """\
[pytest]
addopts = --strict-markers -p no:cacheprovider
markers =
    unit: u
    integration: i
    e2e: e
    cluster: c
"""


def suite(tmp_path: Path, modules: dict[str, str]) -> Path:
    """A package ``tests`` under ``tmp_path`` with this repo's conftest.py and ``modules``."""
    (tmp_path / "pytest.ini").write_text(INI)
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text(CONFTEST.read_text())
    for name, source in modules.items():
        (tests / name).write_text(textwrap.dedent(source))
    return tmp_path


def collect(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args, "tests"],
                          cwd=root, capture_output=True, text=True, timeout=120, check=False)


GOOD = {
    "test_a.py": """
        import pytest

        pytestmark = pytest.mark.unit

        def test_one():
            pass
    """,
    "test_b.py": """
        import pytest

        from tests.helpers import shared

        @pytest.mark.e2e
        @pytest.mark.parametrize("x", [1, 2])
        def test_two(x):
            pass

        @pytest.mark.unit
        def test_three():
            pass
    """,
    "helpers.py": "shared = 1\n",
}


def test_a_suite_whose_tests_have_one_tier_each_collects(tmp_path: Path) -> None:
    proc = collect(suite(tmp_path, GOOD))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 tests collected" in proc.stdout
    proc = collect(tmp_path, "-m", "unit")
    assert proc.returncode == 0 and "2/4 tests collected (2 deselected)" in proc.stdout, proc.stdout


def test_a_test_without_a_tier_or_with_two_stops_collection_naming_it(tmp_path: Path) -> None:
    modules = {
        **GOOD,
        "test_c.py": """
            import pytest

            pytestmark = pytest.mark.unit

            @pytest.mark.integration
            def test_twice():
                pass
        """,
        "test_d.py": """
            import pytest

            @pytest.mark.parametrize("x", [1, 2])
            def test_untiered(x):
                pass
        """,
        "test_e.py": """
            import pytest

            from tests.test_a import test_one
            from . import test_b

            pytestmark = pytest.mark.unit

            def test_importer():
                from tests import test_c  # noqa: F401
        """,
    }
    root = suite(tmp_path, modules)
    for args in ((), ("-m", "unit")):  # deselecting does not hide an untiered test
        proc = collect(root, *args)
        assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
        assert proc.stderr.strip().splitlines() == [
            "ERROR: every test needs exactly one tier mark, one of unit, integration, e2e, "
            "cluster (see tests/conftest.py), and no test module may import another (shared "
            "helpers live in tests/helpers/ or tests/conftest.py):",
            "  tests/test_c.py::test_twice: tiers integration, unit",
            "  tests/test_d.py::test_untiered: no tier",
            "  tests/test_e.py:4 imports the test module tests.test_a",
            "  tests/test_e.py:5 imports the test module .test_b",
            "  tests/test_e.py:10 imports the test module tests.test_c",
        ], proc.stderr
