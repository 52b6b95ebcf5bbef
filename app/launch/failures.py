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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

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

    @property
    def line(self) -> str:
        """``Type: message``, as a traceback's last line would read."""
        return f"{self.error}: {self.message}"


def record_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank{rank}.error.json"


def classify(err: BaseException) -> Kind:
    if isinstance(err, (HangError, CollectiveMismatchError)):
        return "diagnosis"
    if isinstance(err, PeerLostError) or any(w in str(err) for w in GLOO_PEER_LOST):
        return "peer_lost"
    return "error"


@contextlib.contextmanager
def recording_failures(log_dir: Path, rank: int, attempt: int, host: str) -> Iterator[None]:
    """Writes this rank's record if the block raises (once per exception), then re-raises. A
    record left by an earlier attempt of this rank is removed first."""
    path = record_path(log_dir, rank)
    path.unlink(missing_ok=True)
    try:
        yield
    except Exception as err:  # not KeyboardInterrupt/SystemExit: a stop is not a failure
        if not getattr(err, "_rlcomm_recorded", False):
            record = FailureRecord(
                rank, classify(err), type(err).__name__, str(err).strip() or repr(err), attempt,
                host, os.getpid(), time.time(),
            )
            with contextlib.suppress(OSError):  # a full disk must not hide the error itself
                log_dir.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(asdict(record)))
                tmp.replace(path)
            with contextlib.suppress(AttributeError, TypeError):
                err._rlcomm_recorded = True  # type: ignore[attr-defined]
        raise


def read_records(log_dir: Path) -> dict[int, FailureRecord]:
    """The records of the newest attempt, by rank (unreadable ones are skipped)."""
    records: dict[int, FailureRecord] = {}
    for path in log_dir.glob("rank*.error.json"):
        with contextlib.suppress(OSError, ValueError, TypeError):
            record = FailureRecord(**json.loads(path.read_text()))
            records[record.rank] = record
    newest = max((r.attempt for r in records.values()), default=0)
    return {rank: r for rank, r in records.items() if r.attempt == newest}

