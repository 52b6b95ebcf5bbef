"""Each failed rank's failure record, ``logs/rank<N>.error.json``: what the launchers read.

A rank classifies its own error once, where the exception object is at hand, and writes one
small JSON record; the local and SLURM launchers read those records to name the cause of a
failed run, instead of matching text in stderr or in torch elastic's own error files.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from app.errors import WRITE_ERRORS, WriteError
from rlcomm.errors import CollectiveMismatchError, HangError, PeerLostError

# What a failure says about the run:
# - "diagnosis": a hang or collective-mismatch diagnosis, the same on every rank: the run's cause
#   (unless a rank was killed: its peers may hang because of it);
# - "peer_lost": this rank lost a peer (its connection closed); a consequence, reported only when
#   nothing else is;
# - "error": this rank's own error.
Kind = Literal["diagnosis", "peer_lost", "error"]

# gloo's words for a peer whose connection went away (pinned in tests/test_private_apis.py).
GLOO_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote worker")

# Room kept on disk for each rank's record from the start, so that a full disk cannot keep the
# record from being written: a longer message is cut to fit.
RESERVED_BYTES = 8192


@dataclass(frozen=True)
class FailureRecord:
    rank: int
    kind: Kind
    error: str  # the exception's class name
    message: str  # str(exception), possibly several lines
    attempt: int  # the elastic agent's restart count when it failed
    host: str
    pid: int
    time: float
    # For a write error (WRITE_ERRORS): ``no space left on device writing PATH[; note...]``.
    write_error: str | None = None

    @property
    def line(self) -> str:
        """``Type: message``, as a traceback's last line would read."""
        return f"{self.error}: {self.message}"

    @property
    def summary(self) -> str:
        """What a launcher's error line says of this failure: a write error in its words, else
        :attr:`line`."""
        return self.write_error or self.line


def write_error_line(err: BaseException) -> str | None:
    """``no space left on device writing PATH`` (plus the error's notes, ``; ``-joined) for an
    OSError with one of WRITE_ERRORS, found in ``err`` or the errors it was raised from; None
    for any other error. The outermost such error that names its file wins."""
    found: list[OSError] = []
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in WRITE_ERRORS:
            found.append(current)
        current = current.__cause__ or current.__context__
    if not found:
        return None
    named = next((e for e in found if e.filename is not None), found[0])
    line = WRITE_ERRORS[named.errno or 0]
    if named.filename is not None:
        line += f" writing {os.fsdecode(named.filename)}"
    notes = [n for e in found for n in getattr(e, "__notes__", ()) if isinstance(n, str)]
    return "; ".join([line, *dict.fromkeys(n.strip() for n in notes if n.strip())])


@contextlib.contextmanager
def write_errors_named(who: str = "") -> Iterator[None]:
    """An OSError with one of WRITE_ERRORS raised inside becomes a :class:`WriteError`: one
    ``error:`` line (``who`` first, e.g. ``rank 3: ``) and exit code 2, as any other error of a
    run, instead of a traceback."""
    try:
        yield
    except WriteError:
        raise
    except OSError as err:
        line = write_error_line(err)
        if line is None:
            raise
        raise WriteError(who + line) from err


def record_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.error.json"


def _reserve_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f".rank{rank}.error.{os.getpid()}.reserved"


def classify(err: BaseException) -> Kind:
    if isinstance(err, (HangError, CollectiveMismatchError)):
        return "diagnosis"
    if isinstance(err, PeerLostError) or any(w in str(err) for w in GLOO_PEER_LOST):
        return "peer_lost"
    return "error"


@contextlib.contextmanager
def recording_failures(log_dir: Path, rank: int, attempt: int, host: str) -> Iterator[None]:
    """Writes this rank's record if the block raises (once per exception), then re-raises. A
    record left by an earlier attempt of this rank is removed first.

    The record's room on disk is taken when the block starts (a hidden ``.reserved`` file of
    RESERVED_BYTES, removed when the block ends): a block that fails because the disk is full
    still leaves its record, written into that room and renamed."""
    path = record_path(log_dir, rank)
    path.unlink(missing_ok=True)
    reserve = _reserve(log_dir, rank)
    try:
        yield
    except Exception as err:  # not KeyboardInterrupt/SystemExit: a stop is not a failure
        if not getattr(err, "_rlcomm_recorded", False):
            record = FailureRecord(
                rank, classify(err), type(err).__name__, str(err).strip() or repr(err), attempt,
                host, os.getpid(), time.time(), write_error_line(err),
            )
            _write_record(path, record, reserve)
            with contextlib.suppress(AttributeError, TypeError):
                err._rlcomm_recorded = True  # type: ignore[attr-defined]
        raise
    finally:
        if reserve is not None:
            with contextlib.suppress(OSError):
                reserve.unlink(missing_ok=True)


def _reserve(log_dir: Path, rank: int) -> Path | None:
    """The room for this rank's record, or None where even that could not be written."""
    reserve = _reserve_path(log_dir, rank)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        with reserve.open("wb") as handle:
            handle.write(b" " * RESERVED_BYTES)
    except OSError:
        with contextlib.suppress(OSError):
            reserve.unlink(missing_ok=True)
        return None
    return reserve


def _write_record(path: Path, record: FailureRecord, reserve: Path | None) -> None:
    """Written aside and renamed, so a launcher never reads half a record; into the reserved
    room when the disk has none left (a full disk must not hide the error itself)."""
    text = json.dumps(asdict(record)).encode()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_bytes(text)
            tmp.replace(path)
            return
        except OSError:
            tmp.unlink(missing_ok=True)
    if reserve is None:
        return
    message = record.message
    while len(text) > RESERVED_BYTES and message:  # cut the message, not the other fields
        message = message[: max(0, len(message) - (len(text) - RESERVED_BYTES) - 16)]
        text = json.dumps(asdict(replace(record, message=message + " ..."))).encode()
    with contextlib.suppress(OSError):
        # Overwriting bytes the file already holds needs no new room; JSON allows the trailing
        # blanks, but they are cut off anyway.
        with reserve.open("r+b") as handle:
            handle.write(text)
            handle.truncate(len(text))
        reserve.replace(path)


def read_records(log_dir: Path) -> dict[int, FailureRecord]:
    """The records of the newest attempt, by rank (unreadable ones are skipped)."""
    records: dict[int, FailureRecord] = {}
    for path in log_dir.glob("rank*.error.json"):
        with contextlib.suppress(OSError, ValueError, TypeError):
            record = FailureRecord(**json.loads(path.read_text()))
            records[record.rank] = record
    newest = max((r.attempt for r in records.values()), default=0)
    return {rank: r for rank, r in records.items() if r.attempt == newest}


def drop_unreadable_error_file() -> bool:
    """Removes torch's error file for this rank when it could not be written whole (a full
    disk leaves it empty or cut); True if it did."""
    name = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not name:
        return False
    path = Path(name)
    try:
        json.loads(path.read_text())
        return False
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            path.unlink()
        return True
