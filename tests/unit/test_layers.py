"""The app's rooms import along one direction: the launch room (app/launch/) and the sweep report
(app/sweep/) do not import each other, and only the Hydra adapters (app/hydra/) import both;
``python -m app.evaluate`` imports no launch code. Function-local imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

APP = Path(__file__).resolve().parents[2] / "app"

# room -> the packages it must not import
FORBIDDEN = {
    "launch": ("app.sweep", "app.hydra"),
    "sweep": ("app.launch", "app.hydra"),
    "evaluate": ("app.launch", "app.hydra"),
}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_a_room_imports_none_of_the_rooms_above_or_beside_it(room: str) -> None:
    crossings = sorted(
        f"{path.relative_to(APP.parent)} imports {name}"
        for path in (APP / room).rglob("*.py")
        for name in imports(path)
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[room])
    )
    assert crossings == []


# app/runtime/'s layers, bottom to top (docs/how-a-rank-runs.md draws them): a module imports
# only its own folder and the layers below it, so no folder circle can form. The top layer is
# the entry: the modules at app/runtime/ itself, which assemble and run a rank's parts.
RUNTIME = APP / "runtime"
RUNTIME_LAYERS: list[set[str]] = [
    {"core"},  # what an algorithm supplies, segments, seeds, a rank's state, stop requests
    {"envs", "models"},
    {"rollout"},  # acting and collecting
    {"trainer"},  # the trained module, its gradients, the trainer role
    {"checkpoints"},
    {"settings"},  # loop.*: the schema and what it builds
    {"replay"},
    {"membership"},  # the runtime's policy over rlcomm's one membership
    {"handoff"},
    {"evaluation"},
    {"records"},
    {"roles"},  # collector, decider
    {"<entry>"},  # compose.py, run.py, loop.py, validation.py
]


def runtime_unit(module: str) -> str | None:
    """The layer unit of ``app.runtime.<...>``: its folder, or ``<entry>`` for a module at
    app/runtime/ itself; None for what is not in the runtime (or the package itself)."""
    parts = module.split(".")
    if parts[:2] != ["app", "runtime"] or len(parts) < 3:
        return None
    return parts[2] if (RUNTIME / parts[2]).is_dir() else "<entry>"


def test_the_runtimes_folders_import_only_downward() -> None:
    layer = {unit: i for i, units in enumerate(RUNTIME_LAYERS) for unit in units}
    folders = {p.name for p in RUNTIME.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(layer) - {"<entry>"}, "a runtime folder without a layer"
    upward = []
    for path in sorted(RUNTIME.rglob("*.py")):
        if path == RUNTIME / "__init__.py":
            continue
        module = ".".join(path.relative_to(APP.parent).with_suffix("").parts)
        own = runtime_unit(module)
        assert own is not None
        for name in imports(path):
            other = runtime_unit(name)
            if other is None or other == own or (other == "<entry>" == own):
                continue
            if layer[other] >= layer[own]:
                upward.append(f"{path.relative_to(APP.parent)} ({own}) imports {name} ({other})")
    assert upward == [], "upward imports:\n" + "\n".join(upward)


def test_the_layer_check_finds_an_upward_import() -> None:
    """The check above sees an import of a higher layer, a function-local one too."""
    import ast

    source = "def f():\n    from app.runtime.compose import build_rank\n"
    names = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    assert {runtime_unit(n) for n in names} == {"<entry>"}
    assert runtime_unit("app.runtime.core.algorithm") == "core"
