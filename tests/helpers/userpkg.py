"""A user's package outside the repo, as ``loop=custom loop._target_=mypkg.loops.X`` finds it."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.helpers.apprun import REPO


def user_package(tmp_path: Path, source: str) -> dict[str, str]:
    """A package ``mypkg`` under ``tmp_path`` holding ``loops.py`` (``source``); returns the
    environment (PYTHONPATH) in which the app finds it."""
    package = tmp_path / "mypkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "loops.py").write_text(textwrap.dedent(source))
    return {"PYTHONPATH": f"{REPO}:{tmp_path}"}
