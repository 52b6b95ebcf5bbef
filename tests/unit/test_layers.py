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
