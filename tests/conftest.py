"""What every test module shares: the four tiers, and where shared helpers live.

Every test has exactly one tier, and its folder says which: ``tests/<tier>/``. Each test also
carries its tier's mark (a module's ``pytestmark = pytest.mark.<tier>``, or one mark per test),
so ``-m`` selects a tier however the suite was collected and a reader sees the tier in the file.
Collection stops with a usage error naming any test with no tier mark or several, a test
whose mark is not its folder's, and a test module outside the tier folders, so a new test
cannot slip in untiered, and a file moved to another folder (or a test pasted into another
file) cannot keep a tier it no longer has:

- ``unit`` (tests/unit/): in-process, no child processes or ranks, fast:
  ``python -m pytest tests/unit`` (or ``-m unit``) runs the whole tier in under a minute;
- ``integration`` (tests/integration/): real ranks (:func:`rlcomm.testing.run_ranks`) or other
  child processes, or a training run in one process that takes seconds, but not the whole app;
- ``e2e`` (tests/e2e/): runs of the app itself, ``python -m app`` or torchrun, as a user would;
- ``cluster`` (tests/cluster/): a SLURM cluster (tests/slurm) or network-namespace hosts
  (tests/hosts).

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
# The folder that holds the tier folders: this file's.
TESTS = Path(__file__).resolve().parent
_TEST_MODULE = re.compile(r"(?:^|\.)test_\w+$")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problems = [*_untiered(items), *_test_module_imports(items, config.rootpath)]
    if problems:
        raise pytest.UsageError("\n  ".join([
            "every test needs exactly one tier mark, one of "
            f"{', '.join(TIERS)}, the tier of its folder tests/<tier>/ (see tests/conftest.py), "
            "and no test module may import another (shared helpers live in tests/helpers/ or "
            "tests/conftest.py):",
            *problems,
        ]))


def _untiered(items: list[pytest.Item]) -> list[str]:
    """``nodeid: no tier`` (or ``tiers a, b``, ``unit in tests/e2e/``, ``not in a tier folder``),
    once per test function, not per parameter."""
    problems: dict[str, str] = {}
    for item in items:
        tiers = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        folder = _tier_folder(item.path)
        if folder is None:
            what = f"not in a tier folder ({', '.join(f'tests/{tier}/' for tier in TIERS)})"
        elif len(tiers) != 1:
            what = "no tier" if not tiers else f"tiers {', '.join(tiers)}"
        elif tiers[0] != folder:
            what = f"{tiers[0]} in tests/{folder}/"
        else:
            continue
        problems.setdefault(item.nodeid.split("[", 1)[0], what)
    return [f"{test}: {what}" for test, what in problems.items()]


def _tier_folder(path: Path) -> str | None:
    """The tier whose folder holds ``path`` (``tests/<tier>/...``), or None."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


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
                # from tests import test_x, from tests.unit import test_x, from . import test_x
                if node.level or module == "tests" or module.startswith("tests."):
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


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without the plugin
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Three test files run at a time (``-n 3`` in pyproject.toml), a file's tests in one worker
    so that its module fixtures are built once; the cluster tier is one unit, because its
    modules share one SLURM cluster and the same network-namespace hosts."""
    from xdist.scheduler import LoadScopeScheduling

    class FileOrClusterScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/cluster" if path.startswith("tests/cluster/") else path

    return FileOrClusterScheduling(config, log)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``tmpfs(size)``: a fresh tmpfs of ``size`` (mount's syntax: ``4m``), unmounted at
    teardown whatever the test did (tests/helpers/disks.py)."""
    import os

    from tests.helpers.disks import mount, unmount

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mounted: list[Path] = []

    def make(size: str, name: str = "disk") -> Path:
        target = tmp_path / name
        target.mkdir()
        try:
            mount(target, f"size={size},mode=0755")
        except OSError as err:
            pytest.skip(f"cannot mount a tmpfs here: {err}")
        mounted.append(target)
        return target

    yield make
    for target in mounted:
        unmount(target)
        assert not os.path.ismount(target), f"{target} is still mounted"


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
