"""Every code example in a docstring of app/, rlcomm/ and hydra_plugins/ runs.

mkdocstrings publishes these docstrings (docs/api/), so an example that no longer runs is a
published mistake. Found statically (nothing is imported to find them):

- ``>>>`` examples run as doctests, in their module's namespace;
- a reST literal block (a paragraph ending in ``::``) and a fenced ```` ```python ```` block run
  with ``exec`` in a copy of their module's namespace, so they may use the module's own names.
  One that needs a process group (it names ``init_distributed_env`` or ``run_ranks``) is only
  compiled: a unit test starts no ranks.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "rlcomm", "hydra_plugins")
_NEEDS_RANKS = re.compile(r"\binit_distributed_env\b|\brun_ranks\b")
_FENCE = re.compile(r"^```(?:python|py)\s*\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    path: str  # relative to the repository root
    line: int  # of the docstring
    kind: str  # "doctest" or "block"
    code: str

    @property
    def module(self) -> str:
        return ".".join(Path(self.path).with_suffix("").parts).removesuffix(".__init__")

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def _docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, text)`` of the module's docstring and of every class and function's."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=True)
            if text:
                line = node.body[0].lineno if node.body else getattr(node, "lineno", 1)
                found.append((line, text))
    return found


def _literal_blocks(text: str) -> list[str]:
    """The reST literal blocks of ``text``: the indented lines after a line ending in ``::``."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if not line.rstrip().endswith("::"):
            continue
        indent = len(line) - len(line.lstrip())
        body: list[str] = []
        for follow in lines[i + 1:]:
            if follow.strip() and len(follow) - len(follow.lstrip()) <= indent:
                break
            body.append(follow)
        code = textwrap.dedent("\n".join(body)).strip("\n")
        if code:
            blocks.append(code)
    return blocks


def collect_examples() -> list[Example]:
    examples = []
    parser = doctest.DocTestParser()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, text in _docstrings(ast.parse(path.read_text(), filename=rel)):
                if parser.get_examples(text):
                    examples.append(Example(rel, line, "doctest", text))
                for code in [*_literal_blocks(text), *_FENCE.findall(text)]:
                    examples.append(Example(rel, line, "block", code))
    return examples


EXAMPLES = collect_examples()


def test_the_examples_are_found() -> None:
    """The collector sees the runtime loop's example (so an empty list is not a silent pass)."""
    assert any(e.path == "app/runtime/loop.py" and e.kind == "block" for e in EXAMPLES), EXAMPLES


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_docstring_example_runs(example: Example) -> None:
    module = importlib.import_module(example.module)
    if example.kind == "doctest":
        test = doctest.DocTestParser().get_doctest(
            example.code, dict(vars(module)), example.module, example.path, example.line
        )
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test)
        assert runner.failures == 0, f"{example}: {runner.failures} doctest example(s) failed"
        return
    compiled = compile(example.code, str(example), "exec")
    if _NEEDS_RANKS.search(example.code):
        return  # needs a process group: compiled only
    exec(compiled, dict(vars(module)))  # the repository's own docstrings
