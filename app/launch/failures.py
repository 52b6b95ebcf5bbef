"""Failed ranks, and the one line that names why a run failed.

The rank's side: each failed rank's failure record, ``logs/rank<N>.error.json``. A rank
classifies its own error once, where the exception object is at hand, and writes one small JSON
record; the local and SLURM launchers read those records to name the cause of a failed run,
instead of matching text in stderr or in torch elastic's own error files.

The local launcher's side: :class:`DeathWatch` sees which rank died first, and whether a signal
killed it, as it happens (a killed rank leaves no record); :func:`describe_failures` turns the
records and those deaths into the launcher's one ``error:`` line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from app.errors import WRITE_ERRORS, WriteError
from app.launch.private import open_files, started_processes
from rlcomm.errors import CollectiveMismatchError, HangError, MembersLostError, PeerLostError
from rlcomm.net.gloo_words import says_peer_lost

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# What a failure says about the run:
# - "diagnosis": a hang or collective-mismatch diagnosis, the same on every rank: the run's cause
#   (unless a rank was killed: its peers may hang because of it);
# - "peer_lost": this rank lost a peer (its connection closed), or too many members to go on
#   (MembersLostError); a consequence, reported only when nothing else is: which rank notices a
#   loss first, and whether the launcher stops it before it raises, is a race;
# - "error": this rank's own error.
Kind = Literal["diagnosis", "peer_lost", "error"]

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
    if isinstance(err, (PeerLostError, MembersLostError)) or says_peer_lost(str(err)):
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


# ---- the local launcher's side: who died first, and the line that names the cause ----------


class DeathWatch:
    """Which local rank died first, and whether a signal killed it, seen as it happens; and which
    finished rank does not exit.

    The agent reports one failed rank, whichever its poll finds first: often a peer that lost
    its connection to a rank killed a moment before, which wrote no error record. A thread looks
    at the rank processes the agent started (multiprocessing's Process objects of this process)
    every ``period_s``: a process has ended once its sentinel is ready, which reads nothing (the
    agent still collects every exit code), and each is known by the log file it holds open. Only
    the first deaths count: the ranks the agent then stops with SIGTERM are not causes. Their
    exit codes are read once the agent is done with them (:meth:`killed`).

    Once ``result`` (rank 0's result.json) exists, every rank has finished; a rank still running
    ``exit_bound_s`` later is named on the console and killed (:meth:`only_stragglers_failed`).
    """

    def __init__(self, log_dir: Path, world_size: int, result: Path | None = None,
                 exit_bound_s: float = 10.0, period_s: float = 0.05,
                 log: logging.Logger | None = None) -> None:
        self._log_dir, self._world_size, self._period_s = log_dir, world_size, period_s
        self._result, self._exit_bound_s = result, exit_bound_s
        self._log = log or logging.getLogger("rlcomm.launcher")  # where stragglers are named
        self._ranks: dict[BaseProcess, int] = {}  # rank processes still running -> rank
        self._attempt: dict[BaseProcess, int] = {}  # every rank process of this attempt
        self._first: dict[BaseProcess, int] = {}  # the first scan's deaths -> rank
        self._attempt_over = False  # every rank ended: ranks seen next belong to a restart
        self._finished_at: float | None = None  # when result.json appeared (monotonic)
        self.stragglers: dict[int, int] = {}  # rank -> pid, killed for not exiting
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rlcomm-deaths", daemon=True)
        self._thread.start()

    def killed(self) -> dict[int, str]:
        """Ranks among the first to end that a signal killed, with the signal's name."""
        return _signal_names(self._first)

    def signalled(self) -> dict[int, str]:
        """Every rank of this attempt that a signal other than SIGTERM (the agent's stop)
        killed, however late its end was seen."""
        return {rank: name for rank, name in _signal_names(self._attempt).items()
                if name != "SIGTERM"}

    def only_stragglers_failed(self) -> bool:
        """The run finished (result.json), and the only ranks that did not exit cleanly are the
        ones this watch killed because they did not exit after it."""
        if not self.stragglers or self._result is None or not self._result.exists():
            return False
        killed = set(self.stragglers.values())
        return all(p.exitcode == 0 or p.pid in killed for p in self._attempt)

    def running_pids(self) -> list[int]:
        """The pids of the rank processes still running."""
        return sorted(p.pid for p in list(self._ranks) if p.pid is not None)

    def stop(self) -> None:
        """Ends the watching thread (within ``period_s``)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self._period_s):
            if len(self._ranks) < self._world_size:
                self._find_ranks()
            ended: dict[BaseProcess, int] = {}
            for proc in _ended(list(self._ranks)):
                ended[proc] = self._ranks.pop(proc)
            if ended and not self._first:
                self._first = ended
            if not self._ranks and self._first:
                self._attempt_over = True
            self._check_exits()

    def _find_ranks(self) -> None:
        # The agent's ranks among the Process objects this process started (side jobs too).
        for proc in started_processes():
            if proc in self._ranks or proc in self._attempt or proc.pid is None:
                continue
            rank = self._rank_of(proc.pid)
            if rank is None:
                continue
            if self._attempt_over:  # the agent restarted the ranks
                self._first, self._attempt, self._attempt_over = {}, {}, False
            self._ranks[proc] = self._attempt[proc] = rank

    def _check_exits(self) -> None:
        if self._result is None or not self._ranks:
            return
        if self._finished_at is None:
            if not self._result.exists():
                return
            self._finished_at = time.monotonic()
        waited = time.monotonic() - self._finished_at
        if waited < self._exit_bound_s:
            return
        for proc, rank in list(self._ranks.items()):
            if rank in self.stragglers or proc.pid is None:
                continue
            self.stragglers[rank] = proc.pid
            self._log.warning(
                "rank %d (pid %d) has not exited %.1f s after the run finished (%s); killing it "
                "(log: %s)", rank, proc.pid, waited, self._result.name,
                self._log_dir / f"rank{rank}.log")
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)

    def _rank_of(self, pid: int) -> int | None:
        """The rank whose log file (``rank<N>.log`` in the run's logs) process ``pid`` holds."""
        for target in open_files(pid):
            if target.parent == self._log_dir and target.name.startswith("rank"):
                with contextlib.suppress(ValueError):
                    return int(target.stem.removeprefix("rank"))
        return None


def _signal_names(procs: dict[BaseProcess, int]) -> dict[int, str]:
    """Of ``procs`` (process -> rank), the ranks a signal killed, with the signal's name."""
    found = {}
    for proc, rank in procs.items():
        code = proc.exitcode  # the agent has collected it: this reads nothing new
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                found[rank] = signal.Signals(-code).name
    return found


def _ended(procs: list[BaseProcess]) -> list[BaseProcess]:
    """Those of ``procs`` that have ended: their sentinel is ready (nothing is read from it)."""
    sentinels = {}
    for proc in procs:
        with contextlib.suppress(ValueError):  # closed: ended and collected long ago
            sentinels[proc.sentinel] = proc
    if not sentinels:
        return []
    return [sentinels[s] for s in multiprocessing.connection.wait(list(sentinels), timeout=0)
            if isinstance(s, int)]


def describe_failures(
    err: ChildFailedError, run_dir: Path, killed: dict[int, str] | None = None,
    signalled: dict[int, str] | None = None,
) -> str:
    """One line naming the rank(s) that caused the failure, why, and where their logs are.

    The agent reports whichever failed rank it noticed first, often a peer that merely lost its
    connection; every rank's failure record (above) tells the cause apart, and
    ``killed`` (from :class:`DeathWatch`) names the ranks a signal killed, which leave none.
    ``signalled`` (the same, for every rank of the attempt) names the cause when every rank that
    wrote a record only lost a peer and none of the first to end was killed: the forkserver that
    reaps the ranks tells of their ends in no set order, so a busy machine can show a killed
    rank's end after its peers'.
    """
    records = read_records(run_dir / "logs")
    killed = dict(killed or {})
    if (signalled and all(r.kind == "peer_lost" for r in records.values())
            and all(name == "SIGTERM" for name in killed.values())):
        killed.update(signalled)
    why, kinds, writes = _what_each_rank_says(err, run_dir, records, killed)
    causes = {r: w for r, w in why.items() if kinds[r] != "peer_lost"} or why
    if any(w.startswith("killed by") for w in causes.values()):
        # A crash wins: the hang its peers may report is its consequence.
        causes = {r: w for r, w in causes.items() if kinds[r] != "diagnosis"}
    else:
        diagnoses = [records[r].message for r in sorted(causes) if kinds[r] == "diagnosis"]
        if diagnoses:  # the same on every rank that raises it: reported once
            return f"{diagnoses[0]} (logs: {run_dir / 'logs'})"
    return "; ".join(
        f"rank {rank}: {writes[rank]}" if rank in writes
        else f"rank {rank} {text} (log: {run_dir / 'logs' / f'rank{rank}.log'})"
        for rank, text in sorted(causes.items())
    )


def _stopped(err: ChildFailedError, records: dict[int, FailureRecord],
             killed: dict[int, str]) -> set[int]:
    """The ranks the agent stopped with SIGTERM after another failed: not causes. A SIGTERMed
    rank with no record is the cause only where nothing else is: no rank's own error, and no
    rank killed by another signal (a SIGKILL is the failure the agent's SIGTERMs followed)."""
    killed_otherwise = any(f.exitcode < 0 and f.exitcode != -signal.SIGTERM
                           for f in err.failures.values())
    killed_otherwise |= any(name != "SIGTERM" for name in killed.values())
    failed_alone = killed_otherwise or any(r.kind != "peer_lost" for r in records.values())
    sigterms = {r for r, f in err.failures.items() if f.exitcode == -signal.SIGTERM}
    sigterms |= {r for r, name in killed.items() if name == "SIGTERM"}
    return {r for r in sigterms if r in records or failed_alone}


def _what_each_rank_says(
    err: ChildFailedError, run_dir: Path, records: dict[int, FailureRecord],
    killed: dict[int, str],
) -> tuple[dict[int, str], dict[int, Kind], dict[int, str]]:
    """Per failed rank: why (a line), what kind of failure, and for a rank that failed
    writing a file, the whole of its line."""
    why: dict[int, str] = {}
    kinds: dict[int, Kind] = {}
    writes: dict[int, str] = {}
    stopped = _stopped(err, records, killed)
    for rank, failure in err.failures.items():
        if failure.exitcode < 0 and rank not in stopped:
            why[rank], kinds[rank] = f"killed by {failure.signal_name()}", "error"
    for rank in stopped - set(records):
        why[rank], kinds[rank] = "stopped by the launcher after another rank failed", "peer_lost"
    for rank, record in records.items():
        if rank not in why:
            code = err.failures[rank].exitcode if rank in err.failures.keys() - stopped else 1
            why[rank], kinds[rank] = f"exit code {code}: {last_line(record.line)}", record.kind
            if record.write_error and record.kind != "peer_lost":
                writes[rank] = record.write_error
    for rank, failure in err.failures.items():  # failed before it could write a record
        if rank not in why:
            why[rank] = (f"exit code {failure.exitcode}: {error_line(failure.message)}"
                         f"{disk_state(run_dir, 'it left no failure record')}")
            kinds[rank] = "error"
    for rank, name in killed.items():
        if rank not in stopped and (rank not in why or kinds[rank] == "peer_lost"):
            why[rank], kinds[rank] = f"killed by {name}", "error"
            writes.pop(rank, None)
    return why, kinds, writes


def disk_state(run_dir: Path, what: str = "") -> str:
    """``; <what>: <run dir> has no space left on device`` (or is on a read-only file system),
    or "" when neither: why a rank may have left nothing to read."""
    try:
        stat = os.statvfs(run_dir if run_dir.exists() else run_dir.parent)
    except OSError:
        return ""
    if stat.f_flag & os.ST_RDONLY:
        state = f"is on a {WRITE_ERRORS[errno.EROFS]}"
    elif stat.f_bavail == 0:
        state = f"has {WRITE_ERRORS[errno.ENOSPC]}"
    else:
        return ""
    return f"; {what + ': ' if what else ''}{run_dir} {state}"


def last_line(text: str) -> str:
    """The last line of ``text`` (a traceback's: the exception's)."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no error message"


def error_line(message: object) -> str:
    """The exception line of a worker's error record (torch nests it differently by version)."""
    while isinstance(message, dict):
        message = message.get("message", "")
    return last_line(str(message))
