"""``metrics.csv``, written through one row at a time."""

from __future__ import annotations

import contextlib
import csv
import io
import os
from pathlib import Path

from app.runtime.records.rows import COUNT_COLUMNS


class MetricsFile:
    """``metrics.csv``, one row appended and written through per update, so a run that fails
    keeps every row it recorded before. Counts (:data:`COUNT_COLUMNS`) are written as integers.
    A write that fails (a full disk) is cut back to the last whole row and re-raised naming the
    file.

    ``rows``: the rows recorded before this attempt (a resume in the same run dir): the file is
    rewritten with them aside and renamed, so the old file stays whole until the new one is."""

    def __init__(self, path: Path, rows: list[dict[str, float]]) -> None:
        self.path = path
        self._handle: io.FileIO | None = None
        self._fields: list[str] = []
        self._size = 0  # bytes of whole rows written
        if rows:
            self._start(rows)

    def append(self, row: dict[str, float]) -> None:
        if self._handle is None:
            self._start([row])
        else:
            self._write(self._handle, self._encode([row], header=False))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def _start(self, rows: list[dict[str, float]]) -> None:
        self._fields = list(rows[0])
        partial = self.path.with_name(f"{self.path.name}.tmp")
        try:
            handle = io.FileIO(partial, "w")
        except OSError as err:
            err.filename = str(self.path)
            raise
        try:
            self._size = 0
            self._write(handle, self._encode(rows, header=True))
            os.replace(partial, self.path)
        except BaseException:
            handle.close()
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            raise
        self._handle = handle

    def _encode(self, rows: list[dict[str, float]], header: bool) -> bytes:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self._fields)
        if header:
            writer.writeheader()
        writer.writerows(_typed(row) for row in rows)
        return text.getvalue().encode()

    def _write(self, handle: io.FileIO, data: bytes) -> None:
        """All of ``data``, unbuffered (a short write goes on where it stopped), or nothing."""
        try:
            view = memoryview(data)
            while view:
                view = view[handle.write(view) or 0 :]
        except OSError as err:
            with contextlib.suppress(OSError):  # shrinking a file needs no room
                os.ftruncate(handle.fileno(), self._size)
            err.filename = str(self.path)
            raise
        self._size += len(data)


def _typed(row: dict[str, float]) -> dict[str, float]:
    """``row`` with each whole count an int, as metrics.csv writes it."""
    return {name: int(value) if name in COUNT_COLUMNS and float(value).is_integer() else value
            for name, value in row.items()}
