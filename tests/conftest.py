"""What every test module shares: the four tiers, and where shared helpers live.

Every test has exactly one tier (a module's ``pytestmark = pytest.mark.<tier>``, or one mark per
test where a module mixes tiers); collection stops with a usage error naming any test with none
or several, so a new test cannot slip in untiered:

- ``unit``: in-process, no child processes or ranks, fast: ``python -m pytest -m unit`` runs the
  whole tier in under a minute;
- ``integration``: real ranks (:func:`rlcomm.testing.run_ranks`) or other child processes, but
  not the whole app;
- ``e2e``: runs of the app itself, ``python -m app`` or torchrun, as a user would;
- ``cluster``: a SLURM cluster (tests/slurm) or network-namespace hosts (tests/hosts).

Plain ``python -m pytest`` (CI) runs every tier. No test module imports another: helpers that
several modules use live in tests/helpers/ (plain modules) or here (fixtures); collection stops
with a usage error naming an import of a test module.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.helpers.apprun import AppProcess

TIERS = ("unit", "integration", "e2e", "cluster")
_TEST_MODULE = re.compile(r"(?:^|\.)test_\w+$")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems = [*_untiered(items), *_test_module_imports(items, config.rootpath)]
    if problems:
        raise pytest.UsageError("\n  ".join([
            "every test needs exactly one tier mark, one of "
            f"{', '.join(TIERS)} (see tests/conftest.py), and no test module may import "
            "another (shared helpers live in tests/helpers/ or tests/conftest.py):",
            *problems,
        ]))


def _untiered(items: list[pytest.Item]) -> list[str]:
    """``nodeid: no tier`` (or ``tiers a, b``), once per test function, not per parameter."""
    problems: dict[str, str] = {}
    for item in items:
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        if len(tiers) != 1:
            test = item.nodeid.split("[", 1)[0]
            problems.setdefault(test, "no tier" if not tiers else f"tiers {', '.join(tiers)}")
    return [f"{test}: {what}" for test, what in problems.items()]


def _test_module_imports(items: list[pytest.Item], root: Path) -> list[str]:
    """``path:line imports tests.test_x`` for every import of a test module by a test module."""
    problems = []
    for path in sorted({item.path for item in items if item.path.name.startswith("test_")}):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                names = [module]
                if module.strip(".") in ("", "tests"):  # from tests import test_x, from . import
                    dot = "" if module.endswith(".") else "."
                    names += [f"{module}{dot}{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if _TEST_MODULE.search(name):
                    where = path.relative_to(root) if path.is_relative_to(root) else path
                    problems.append(f"{where}:{node.lineno} imports the test module {name}")
                    break
    return problems


@pytest.fixture
def start_app(tmp_path: Path) -> Iterator[Callable[..., AppProcess]]:
    """``start_app(name, *overrides, run_dir=..., env=..., prefix=...)`` starts ``python -m app``
    as a user would (tests/helpers/apprun.py); whatever a test leaves running is killed (and
    reported as a survivor) at teardown."""
    from tests.helpers.apprun import AppProcess

    apps: list[AppProcess] = []

    def start(name: str, *overrides: str, run_dir: Path | None = None,
              env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> AppProcess:
        app = AppProcess(name, tmp_path, overrides, run_dir or tmp_path / name, env or {}, prefix)
        apps.append(app)
        return app

    yield start
    for app in apps:
        app.close()
