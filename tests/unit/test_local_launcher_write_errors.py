"""Write errors are named (docs/data-safety.md): a full disk, a quota, a read-only run dir end
the run with one line naming the file and the error. Here, in this process: the line itself,
the local launcher's line for a rank that failed writing, and each writer alone on a full disk
(the failure record, metrics.csv, a rank's log, the launcher's own log). Whole runs on such
disks are tests/e2e/test_local_launcher_write_errors.py.

The disks are real: small tmpfs mounts (root only; CI is root), always unmounted
(the ``tmpfs`` fixture, tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from app.errors import RankFailedError, naming
from app.launch.failures import (
    FailureRecord,
    describe_failures,
    read_records,
    record_path,
    recording_failures,
    write_error_line,
    write_errors_named,
)
from app.launch.local import read_result
from app.output.logs import RankFileHandler, quiet_file_errors
from app.runtime.records import HistoryFile
from tests.helpers.disks import fill

# ---- the line: unit tests ----------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("code", "words"), [
    (errno.ENOSPC, "no space left on device"),
    (errno.EDQUOT, "disk quota exceeded"),
    (errno.EROFS, "read-only file system"),
    (errno.EACCES, "permission denied"),
])
def test_a_write_error_reads_as_one_line_naming_the_file_and_its_notes(
    code: int, words: str
) -> None:
    err = OSError(code, os.strerror(code), "/runs/a/checkpoints/ckpt_000040.pt")
    assert write_error_line(err) == f"{words} writing /runs/a/checkpoints/ckpt_000040.pt"
    err.add_note("the last checkpoint is ckpt_000030.pt")
    assert write_error_line(err) == (
        f"{words} writing /runs/a/checkpoints/ckpt_000040.pt; the last checkpoint is ckpt_000030.pt"
    )


@pytest.mark.unit
def test_a_write_error_is_found_behind_the_error_raised_from_it_and_others_are_not() -> None:
    named = OSError(errno.ENOSPC, "No space left on device", "/r/metrics.csv")
    try:
        try:
            raise named
        except OSError:
            raise OSError(errno.ENOSPC, "No space left on device") from None  # names no file
    except OSError as outer:
        outer.__cause__ = named
        assert write_error_line(outer) == "no space left on device writing /r/metrics.csv"
    assert write_error_line(OSError(errno.ENOSPC, "No space left on device")) == \
        "no space left on device"
    assert write_error_line(FileNotFoundError(errno.ENOENT, "gone", "/r/x")) is None
    assert write_error_line(RuntimeError("boom")) is None
    with pytest.raises(RuntimeError), write_errors_named():
        raise RuntimeError("boom")  # not a write error: untouched
    with pytest.raises(Exception, match=r"^rank 3: read-only file system writing /r/layout.txt$") \
            as caught, write_errors_named("rank 3: "):
        raise OSError(errno.EROFS, "Read-only file system", "/r/layout.txt")
    assert getattr(caught.value, "exit_code", None) == 2


@pytest.mark.unit
def test_a_write_through_an_open_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(OSError) as caught, naming(tmp_path / "result.json"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert caught.value.filename == str(tmp_path / "result.json")


def _failed(run_dir: Path, *ranks: int) -> ChildFailedError:
    return ChildFailedError("app", {
        rank: ProcessFailure(rank, 1000 + rank, 1, str(run_dir / "no-error-file")) for rank in ranks
    })


def _record(run_dir: Path, rank: int, err: Exception) -> None:
    with pytest.raises(type(err)), recording_failures(run_dir / "logs", rank, 0, "h"):
        raise err


@pytest.mark.unit
def test_the_launchers_line_for_a_rank_that_failed_writing_is_the_write_error_alone(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "checkpoints" / "ckpt_000040.pt"
    err = OSError(errno.ENOSPC, "No space left on device", str(ckpt))
    err.add_note("the last checkpoint is ckpt_000030.pt")
    _record(tmp_path, 0, err)
    _record(tmp_path, 1, RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:5"))
    assert read_records(tmp_path / "logs")[0].summary == (
        f"no space left on device writing {ckpt}; the last checkpoint is ckpt_000030.pt"
    )
    assert describe_failures(_failed(tmp_path, 0, 1), tmp_path) == (
        f"rank 0: no space left on device writing {ckpt}; the last checkpoint is ckpt_000030.pt"
    )


@pytest.mark.unit
def test_a_missing_or_cut_result_json_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError) as caught:
        read_result(tmp_path)
    assert str(caught.value) == \
        f"the ranks ended, but rank 0's summary {tmp_path / 'result.json'} cannot be read: it is missing"
    (tmp_path / "result.json").write_text('{"status": "o')
    with pytest.raises(RankFailedError, match=r"cannot be read: it is not JSON \(JSONDecodeError: "):
        read_result(tmp_path)


# ---- on a real full disk: each writer alone ----------------------------------------------------


@pytest.mark.unit
def test_a_failure_record_is_written_on_a_disk_that_is_already_full(
    tmpfs: Callable[..., Path],
) -> None:
    disk = tmpfs("256k")
    logs = disk / "logs"
    cause = OSError(errno.ENOSPC, "No space left on device", str(disk / "metrics.csv"))
    with pytest.raises(OSError), recording_failures(logs, 0, 0, "h"):
        fill(disk)  # after the block started: the room for its record was kept then
        with pytest.raises(OSError):
            (disk / "more").write_bytes(b"x" * 4096)
        raise cause
    record = read_records(logs)[0]
    assert record.summary == f"no space left on device writing {disk / 'metrics.csv'}"
    assert [p.name for p in logs.iterdir()] == [record_path(logs, 0).name]
    # A message longer than the room is cut, the record still whole.
    (disk / "filler").unlink()
    with pytest.raises(ValueError), recording_failures(logs, 1, 0, "h"):
        fill(disk)
        raise ValueError("x" * 50_000)
    long = read_records(logs)[1]
    assert isinstance(long, FailureRecord) and long.message.endswith(" ...")
    assert not list(logs.glob(".*reserved"))


@pytest.mark.unit
def test_metrics_rows_written_before_the_disk_filled_stay_whole(
    tmpfs: Callable[..., Path],
) -> None:
    disk = tmpfs("64k")
    fill(disk, leave=8192)
    metrics = HistoryFile(disk / "metrics.csv")
    row = {"update": 0.0, "env_steps": 0.0, "mean_return": 21.123456789, "pg_loss": -0.0123456789}
    written = 0
    with pytest.raises(OSError) as caught:
        for update in range(1, 10_000):
            metrics.append([{**row, "update": float(update)}])
            written = update
    metrics.close()
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(disk / "metrics.csv")
    assert write_error_line(caught.value) == f"no space left on device writing {disk / 'metrics.csv'}"
    with (disk / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert written > 10 and [int(float(r["update"])) for r in rows] == list(range(1, written + 1))
    assert all(None not in r.values() and r["pg_loss"] == "-0.0123456789" for r in rows)
    assert (disk / "metrics.csv").read_bytes().endswith(b"\n")
    assert not list(disk.glob("*.tmp"))


@pytest.mark.unit
def test_a_rank_log_the_disk_refuses_is_raised_once_naming_it(
    tmpfs: Callable[..., Path],
) -> None:
    disk = tmpfs("64k")
    fill(disk, leave=4096)
    handler = RankFileHandler(disk / "rank0.log")
    logger = logging.getLogger("test_disk.rank_log")
    logger.propagate, logger.level = False, logging.INFO
    logger.addHandler(handler)
    try:
        with pytest.raises(OSError) as caught:
            for n in range(10_000):
                logger.info("record %d %s", n, "y" * 200)
        assert write_error_line(caught.value) == \
            f"no space left on device writing {disk / 'rank0.log'}"
        logger.info("the error path logs too")  # once only: no second error, no traceback
    finally:
        logger.removeHandler(handler)
        with contextlib.suppress(OSError):
            handler.close()


@pytest.mark.unit
def test_the_launchers_own_log_file_on_a_full_disk_is_turned_off_in_one_line(
    tmpfs: Callable[..., Path], capsys: pytest.CaptureFixture[str],
) -> None:
    disk = tmpfs("64k")
    fill(disk, leave=4096)
    logger = logging.getLogger("test_disk.launcher_log")
    logger.propagate, logger.level = False, logging.INFO
    handler = logging.FileHandler(disk / "__main__.log")  # as Hydra's job logging opens it
    logger.addHandler(handler)
    try:
        quiet_file_errors(logger)
        for n in range(200):  # no exception, no traceback per record
            logger.info("record %d %s", n, "y" * 200)
        assert handler not in logger.handlers
    finally:
        logger.removeHandler(handler)
        with contextlib.suppress(OSError):
            handler.close()
    assert capsys.readouterr().err.splitlines() == [
        f"[launcher] no space left on device writing {disk / '__main__.log'}: it is written no more"
    ]
