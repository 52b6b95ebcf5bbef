"""mkdocs hook: render the docstrings' Sphinx roles (``:class:`~rlcomm.X` ``) as plain code.

The docstrings use reST roles; mkdocstrings passes them through as text, so ``:meth:`bind```
would show as ":meth:bind". This keeps the name (the last part after ``~``) and drops the role.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):<code>(~?)([^<]+)</code>")


def _name(match: re.Match[str]) -> str:
    tilde, target = match.group(1), match.group(2)
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(_name, html)
