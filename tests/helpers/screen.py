"""A terminal emulator for tests of what a person sees on a terminal (tests/unit/test_run_view.py,
tests/e2e/test_run_view.py)."""

from __future__ import annotations

import re

_CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


class Screen:
    """What a terminal ``columns`` wide shows after some output: enough of a VT100 for what
    tqdm and the app write (carriage return, line feed, backspace, cursor up, erase line)."""

    def __init__(self, columns: int) -> None:
        self.columns = columns
        self.rows: list[list[str]] = [[]]
        self.row = self.col = 0

    def feed(self, text: str) -> Screen:
        i = 0
        while i < len(text):
            char = text[i]
            if char == "\x1b":
                match = _CSI.match(text, i)
                assert match, f"unexpected escape sequence {text[i:i + 8]!r}"
                self._control(match.group(1), match.group(2))
                i = match.end()
                continue
            if char == "\r":
                self.col = 0
            elif char == "\n":  # line feed; the terminal's ONLCR sends "\r\n" for "\n"
                self._down()
            elif char == "\b":
                self.col = max(0, self.col - 1)
            elif char >= " ":
                self._put(char)
            i += 1
        return self

    def lines(self) -> list[str]:
        """The screen's non-blank lines, top to bottom."""
        return [text for row in self.rows if (text := "".join(row).rstrip())]

    def _control(self, params: str, command: str) -> None:
        count = int(params) if params.isdigit() else 1
        if command == "A":
            self.row = max(0, self.row - count)
        elif command == "K" and params in ("", "0"):
            del self.rows[self.row][self.col :]
        # Anything else (cursor visibility, colours) does not move text.

    def _down(self) -> None:
        self.row += 1
        while len(self.rows) <= self.row:
            self.rows.append([])

    def _put(self, char: str) -> None:
        if self.col == self.columns:  # auto-wrap, as a terminal does
            self._down()
            self.col = 0
        line = self.rows[self.row]
        line.extend(" " * (self.col + 1 - len(line)))
        line[self.col] = char
        self.col += 1
