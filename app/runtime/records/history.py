"""The run's history files: ``metrics.csv`` (a row per update) and ``episodes.csv`` (a row per
finished episode), append-only, written through one batch of rows at a time.

Their size grows with the run, linearly; nothing else does: a checkpoint records only how far
into each file the run was (:class:`Offset`), and a resumed run cuts each file back to that
offset before it goes on, so that no update or episode is written twice
(docs/data-safety.md, "What grows with a run").
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS_CSV = "metrics.csv"
EPISODES_CSV = "episodes.csv"
EPISODE_COLUMNS = ("episode", "update", "env_steps", "return", "length")


@dataclass(frozen=True)
class Offset:
    """How far into a history file a run was: whole ``rows`` written, and the ``size`` in bytes
    they (and the header) take."""

    rows: int = 0
    size: int = 0

    def as_list(self) -> list[int]:
        """As a checkpoint keeps it (plain values only)."""
        return [self.rows, self.size]

    @classmethod
    def from_saved(cls, saved: Any) -> Offset:
        rows, size = saved
        return cls(int(rows), int(size))


class HistoryFile:
    """One append-only CSV, written through: a run that fails keeps every row it recorded
    before. Counts (``counts``: column names) are written as integers. A write that fails (a
    full disk) is cut back to the last whole row and re-raised naming the file.

    ``at``: where a resumed run goes on (the file is cut back to it: the rows past it belong to
    updates the run makes again); None, a new file (anything there, an earlier attempt's rows
    before its first checkpoint, is dropped)."""

    def __init__(self, path: Path, counts: frozenset[str] = frozenset(),
                 at: Offset | None = None) -> None:
        self.path, self.counts = path, counts
        self._lock = threading.Lock()  # a checkpoint's writer syncs the file from its thread
        self._fields: list[str] = []
        self._handle: io.FileIO | None = None
        self._rows, self._size = 0, 0
        if at is not None and at.size > 0:
            self._reopen(at)

    @property
    def offset(self) -> Offset:
        """Where the file ends now (whole rows only)."""
        return Offset(self._rows, self._size)

    def append(self, rows: Iterable[Mapping[str, Any]]) -> None:
        rows = list(rows)
        if not rows:
            return
        if self._handle is None:
            self._start(list(rows[0]))
        assert self._handle is not None
        self._write(self._handle, self._encode(rows))
        self._rows += len(rows)

    def sync(self) -> None:
        """The rows written so far, durable (a checkpoint that records this file's offset is
        renamed into place only after them)."""
        with self._lock:
            if self._handle is not None:
                os.fsync(self._handle.fileno())

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._handle.close()
                self._handle = None

    def _start(self, fields: list[str]) -> None:
        """A new file with its header (replacing whatever was there)."""
        self._fields = fields
        try:
            handle = io.FileIO(self.path, "w")
        except OSError as err:
            err.filename = str(self.path)
            raise
        self._handle, self._size = handle, 0
        header = io.StringIO()
        csv.writer(header).writerow(fields)
        self._write(handle, header.getvalue().encode())

    def _reopen(self, at: Offset) -> None:
        """The file cut back to ``at``, its header read back; a file shorter than ``at`` (rows
        the disk lost) is kept to its last whole row."""
        try:
            handle = io.FileIO(self.path, "r+")
        except FileNotFoundError:
            return  # nothing to go on from: a new file at the first row
        except OSError as err:
            err.filename = str(self.path)
            raise
        size = min(at.size, os.fstat(handle.fileno()).st_size)
        head = os.pread(handle.fileno(), min(size, 1 << 16), 0)
        if size < at.size:  # cut to the last whole row
            size = os.pread(handle.fileno(), size, 0).rfind(b"\n") + 1
        first = head.split(b"\n", 1)[0].decode()
        self._fields = next(csv.reader([first])) if first else []
        os.ftruncate(handle.fileno(), size)
        handle.seek(size)
        self._handle, self._size = handle, size
        self._rows = at.rows if size == at.size else max(0, _lines(handle, size) - 1)
        if not self._fields:  # not even a header survived
            handle.close()
            self._handle, self._size, self._rows = None, 0, 0

    def _encode(self, rows: list[Mapping[str, Any]]) -> bytes:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self._fields)
        writer.writerows(self._typed(row) for row in rows)
        return text.getvalue().encode()

    def _typed(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """``row`` with each whole count an int, as the file writes it."""
        return {name: int(value) if name in self.counts and float(value).is_integer() else value
                for name, value in row.items()}

    def _write(self, handle: io.FileIO, data: bytes) -> None:
        """All of ``data``, unbuffered (a short write goes on where it stopped), or nothing."""
        try:
            view = memoryview(data)
            while view:
                view = view[handle.write(view) or 0:]
        except OSError as err:
            with contextlib.suppress(OSError):  # shrinking a file needs no room
                os.ftruncate(handle.fileno(), self._size)
                handle.seek(self._size)
            err.filename = str(self.path)
            raise
        self._size += len(data)


def _lines(handle: io.FileIO, size: int) -> int:
    return os.pread(handle.fileno(), size, 0).count(b"\n")


def offset_after_update(path: Path, update: int) -> Offset:
    """Where ``path`` (a metrics.csv) ends after its rows of updates up to ``update``: for a
    checkpoint that recorded no offsets (written before they were recorded)."""
    if not path.exists():
        return Offset()
    rows = size = 0
    with path.open("rb") as handle:
        header = handle.readline()
        if not header:
            return Offset()
        fields = next(csv.reader([header.decode()]))
        if "update" not in fields:
            return Offset()
        column, size = fields.index("update"), len(header)
        for line in handle:
            cells = next(csv.reader([line.decode()]), [])
            if not line.endswith(b"\n") or len(cells) <= column or \
                    float(cells[column]) > update:
                break
            rows, size = rows + 1, size + len(line)
    return Offset(rows, size)
