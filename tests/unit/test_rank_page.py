"""docs/how-a-rank-runs.md draws a rank's parts with the file of each: every file it names
exists, and every name it gives a part is defined in that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "how-a-rank-runs.md"
# "Name (folder/file.py)" in the picture: a part and the file that defines it.
PART = re.compile(r"\b([A-Z][A-Za-z]+|build_rank|run_rank)\s+\((?:runtime/)?([a-z_0-9/]+\.py)\)")


def picture() -> str:
    text = PAGE.read_text()
    return text.split("```text", 1)[1].split("```", 1)[0]


def test_every_file_the_picture_names_exists() -> None:
    files = set(re.findall(r"[a-z_0-9]+(?:/[a-z_0-9]+)*\.py", picture()))
    assert len(files) >= 12, files  # the picture was found
    runtime = REPO / "app" / "runtime"
    missing = sorted(f for f in files
                     if not (runtime / f).exists() and not (runtime / f.removeprefix("runtime/")).exists())
    assert missing == [], f"docs/how-a-rank-runs.md names files that do not exist: {missing}"


def test_every_part_is_defined_in_the_file_beside_it() -> None:
    parts = PART.findall(picture())
    assert len(parts) >= 10, parts
    runtime = REPO / "app" / "runtime"
    wrong = []
    for name, file in parts:
        source = (runtime / file).read_text()
        if not re.search(rf"^(class|def) {name}\b|^    def {name}\b", source, re.MULTILINE):
            wrong.append(f"{name} ({file})")
    assert wrong == [], f"not defined where the page says: {wrong}"
