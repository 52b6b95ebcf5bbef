"""tests/conftest.py's rules, on a throwaway test suite run by a real pytest: every test has one
tier, the tier of its folder (tests/<tier>/), and no test module imports another."""

from __future__ import annotations

import os
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
    """A package ``tests`` under ``tmp_path`` with this repo's conftest.py and ``modules``
    (``unit/test_a.py``: in the package ``tests.unit``)."""
    (tmp_path / "pytest.ini").write_text(INI)
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text(CONFTEST.read_text())
    for name, source in modules.items():
        path = tests / name
        if not path.parent.exists():
            path.parent.mkdir(parents=True)
            (path.parent / "__init__.py").write_text("")
        path.write_text(textwrap.dedent(source))
    return tmp_path


def collect(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # A pytest of its own: not a worker of this run's xdist (its PYTEST_XDIST_* variables).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args, "tests"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120,
                          check=False)


GOOD = {
    "unit/test_a.py": """
        import pytest

        pytestmark = pytest.mark.unit

        def test_one():
            pass
    """,
    "unit/test_b.py": """
        import pytest

        @pytest.mark.unit
        def test_three():
            pass
    """,
    "e2e/test_b.py": """
        import pytest

        from tests.helpers import shared

        @pytest.mark.e2e
        @pytest.mark.parametrize("x", [1, 2])
        def test_two(x):
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


def test_a_test_without_a_tier_with_two_or_in_another_tiers_folder_stops_collection(
    tmp_path: Path,
) -> None:
    modules = {
        **GOOD,
        "unit/test_c.py": """
            import pytest

            pytestmark = pytest.mark.unit

            @pytest.mark.integration
            def test_twice():
                pass
        """,
        "unit/test_d.py": """
            import pytest

            @pytest.mark.parametrize("x", [1, 2])
            def test_untiered(x):
                pass
        """,
        "unit/test_e.py": """
            import pytest

            from tests.unit.test_a import test_one
            from . import test_b
            from tests.e2e import test_b as other

            pytestmark = pytest.mark.unit

            def test_importer():
                from tests.unit import test_c  # noqa: F401
        """,
        "integration/test_f.py": """
            import pytest

            pytestmark = pytest.mark.unit

            def test_misplaced():
                pass
        """,
        "test_g.py": """
            import pytest

            @pytest.mark.unit
            def test_loose():
                pass
        """,
    }
    root = suite(tmp_path, modules)
    for args in ((), ("-m", "unit")):  # deselecting does not hide an untiered test
        proc = collect(root, *args)
        assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
        assert proc.stderr.strip().splitlines() == [
            "ERROR: every test needs exactly one tier mark, one of unit, integration, e2e, "
            "cluster, the tier of its folder tests/<tier>/ (see tests/conftest.py), and no test "
            "module may import another (shared helpers live in tests/helpers/ or "
            "tests/conftest.py):",
            "  tests/integration/test_f.py::test_misplaced: unit in tests/integration/",
            "  tests/test_g.py::test_loose: not in a tier folder (tests/unit/, "
            "tests/integration/, tests/e2e/, tests/cluster/)",
            "  tests/unit/test_c.py::test_twice: tiers integration, unit",
            "  tests/unit/test_d.py::test_untiered: no tier",
            "  tests/unit/test_e.py:4 imports the test module tests.unit.test_a",
            "  tests/unit/test_e.py:5 imports the test module .test_b",
            "  tests/unit/test_e.py:6 imports the test module tests.e2e.test_b",
            "  tests/unit/test_e.py:11 imports the test module tests.unit.test_c",
        ], proc.stderr
