"""Write errors are named (docs/data-safety.md): a full disk, a quota, a read-only run dir end
the run with one line naming the file and the error, exit code 2, nothing left running, the last
checkpoint resumable and every metrics.csv row written before the error whole.

The disks are real: small tmpfs mounts (root only; CI is root), always unmounted.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import errno
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
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
from app.runtime.records import MetricsFile
from tests.helpers.apprun import AppProcess, describe, run_app

_MS_RDONLY, _MS_REMOUNT, _MNT_DETACH = 1, 32, 2
_LIBC = ctypes.CDLL(None, use_errno=True)
# A PPO run of 2 ranks (1 trainer, 1 rollout) that would go on for long; 256 env steps an update.
PPO_SMALL = ("layout=1t1r", "loop.hparams={num_envs:4,num_steps:64}", "loop.progress=false",
             "loop.target_return=1e9")
STEPS_PER_UPDATE = 4 * 64


def _mount(target: Path, options: str, flags: int = 0) -> None:
    if _LIBC.mount(b"tmpfs", os.fsencode(target), b"tmpfs", flags, options.encode()) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(target))


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``tmpfs(size)``: a fresh tmpfs of ``size`` (mount's syntax: ``4m``), unmounted at
    teardown whatever the test did."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mounted: list[Path] = []

    def mount(size: str, name: str = "disk") -> Path:
        target = tmp_path / name
        target.mkdir()
        try:
            _mount(target, f"size={size},mode=0755")
        except OSError as err:
            pytest.skip(f"cannot mount a tmpfs here: {err}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        _LIBC.umount2(os.fsencode(target), _MNT_DETACH)
        assert not os.path.ismount(target), f"{target} is still mounted"


def read_only(disk: Path) -> None:
    _mount(disk, "", _MS_REMOUNT | _MS_RDONLY)


def fill(disk: Path, leave: int = 0) -> None:
    """Takes the disk's free space but ``leave`` bytes (0: until a write is refused)."""
    stat = os.statvfs(disk)
    room = stat.f_bavail * stat.f_frsize - leave
    with open(disk / "filler", "wb", buffering=0) as handle:
        chunk = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):
            while room > 0:
                room -= handle.write(chunk[: min(len(chunk), room)])
            if leave == 0:
                while True:
                    handle.write(b"\0" * 4096)


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
    metrics = MetricsFile(disk / "metrics.csv", [])
    row = {"update": 0.0, "env_steps": 0.0, "mean_return": 21.123456789, "pg_loss": -0.0123456789}
    written = 0
    with pytest.raises(OSError) as caught:
        for update in range(1, 10_000):
            metrics.append({**row, "update": float(update)})
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


# ---- whole runs --------------------------------------------------------------------------------


def _start(tmp_path: Path, name: str, run_dir: Path, *overrides: str) -> AppProcess:
    return AppProcess(name, tmp_path, (*PPO_SMALL, *overrides), run_dir, {}, ())


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt_*.pt"))


def _metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert (run_dir / "metrics.csv").read_bytes().endswith(b"\n")
    assert all(None not in r.values() and "" not in r.values() for r in rows), rows[-1:]
    return rows


@pytest.mark.e2e
def test_a_disk_that_fills_ends_the_run_in_one_line_and_its_last_checkpoint_resumes(
    tmp_path: Path, tmpfs: Callable[..., Path],
) -> None:
    disk = tmpfs("48m")
    run_dir = disk / "run"
    app = _start(tmp_path, "fills", run_dir, f"loop.total_env_steps={10**9}",
                 "loop.checkpoint_every=2")
    try:
        app.wait_until("a checkpoint", lambda: bool(_checkpoints(run_dir)))
        # Room for a few metrics rows and log lines, not for a checkpoint (over 100 KiB).
        fill(disk, leave=32 * 1024)
        code = app.wait()
    finally:
        app.close()
    app.assert_all_ended()
    last = _checkpoints(run_dir)[-1]
    lost = f"ckpt_{int(last[5:11]) + 2:06d}.pt"
    assert code == 2, app.describe()
    assert app.stderr.strip().splitlines()[-1] == (
        f"error: rank 0: no space left on device writing {run_dir / 'checkpoints' / lost}; "
        f"the last checkpoint is {last}"
    ), app.describe()
    assert "Traceback" not in app.stderr, app.describe()
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    rows = _metrics_rows(run_dir)
    assert [int(float(r["update"])) for r in rows] == list(range(1, len(rows) + 1))
    assert len(rows) >= int(last[5:11])
    # Resumable: from the failed run into another dir, on to a budget two updates further on.
    resumed = tmp_path / "resumed"
    updates = int(last[5:11]) + 2
    proc = run_app(*PPO_SMALL, f"hydra.run.dir={resumed}", f"loop.resume={run_dir}",
                   f"loop.total_env_steps={updates * STEPS_PER_UPDATE}")
    assert proc.returncode == 0, describe(proc)
    log = (resumed / "logs" / "rank0.log").read_text()
    assert re.search(rf"resumed from \S+/{last} at update {int(last[5:11])} ", log), log
    result = json.loads((resumed / "result.json").read_text())
    assert [r["result"]["updates"] for r in result["ranks"]] == [updates, updates]


# A transformer trained tensor-parallel x FSDP on 4 colocated trainers: sharded checkpoints,
# one shard file per trainer (docs/sharding.md); 512 env steps an update.
SHARDED = ("+experiment=memory", "layout=tp2dp2", "loop.data_parallel=fsdp",
           "loop.model.width=16", "loop.model.heads=2", "loop.model.layers=1",
           "loop.model.context=4", "loop.hparams.num_envs=4", "loop.hparams.num_steps=32",
           "loop.progress=false", "loop.target_return=1e9", "comm.timeout=120")


def _folders(run_dir: Path) -> list[str]:
    folder = run_dir / "checkpoints"
    return sorted(p.name for p in folder.glob("ckpt_*") if p.is_dir() and p.suffix != ".tmp")


@pytest.mark.e2e
def test_a_disk_that_fills_under_sharded_checkpoints_names_the_shard_and_the_last_resumes(
    tmp_path: Path, tmpfs: Callable[..., Path],
) -> None:
    disk = tmpfs("48m")
    run_dir = disk / "run"
    app = AppProcess("sharded", tmp_path, (*SHARDED, f"loop.total_env_steps={10**9}",
                                           "loop.checkpoint_every=2"), run_dir, {}, ())
    try:
        app.wait_until("a checkpoint", lambda: bool(_folders(run_dir)))
        # Room for a few metrics rows and log lines, not for four shard files (over 60 KiB each).
        fill(disk, leave=32 * 1024)
        code = app.wait()
    finally:
        app.close()
    app.assert_all_ended()
    assert code == 2, app.describe()
    last = _folders(run_dir)[-1]
    # One line: the first trainer whose shard did not fit names the checkpoint it lost (or
    # the file in it, where the error names one) and the last complete one.
    lost = re.escape(str(run_dir / "checkpoints" / f"ckpt_{int(last[5:11]) + 2:06d}"))
    assert re.fullmatch(rf"error: rank \d: no space left on device writing {lost}(/[^;/]+)?; "
                        rf"the last checkpoint is {last}",
                        app.stderr.strip().splitlines()[-1]), app.describe()
    assert "Traceback" not in app.stderr, app.describe()
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    # Resumable: from the failed run into another dir, two updates further on.
    resumed = tmp_path / "resumed"
    updates = int(last[5:11]) + 2
    proc = run_app(*SHARDED, f"hydra.run.dir={resumed}", f"loop.resume={run_dir}",
                   f"loop.total_env_steps={updates * 512}")
    assert proc.returncode == 0, describe(proc)
    log = (resumed / "logs" / "rank0.log").read_text()
    assert re.search(rf"resumed from \S+/{last} at update {int(last[5:11])} ", log), log
    result = json.loads((resumed / "result.json").read_text())
    assert [r["result"]["updates"] for r in result["ranks"]] == [updates] * 4


@pytest.mark.e2e
def test_a_disk_with_no_room_left_at_all_is_still_named_in_one_line(
    tmp_path: Path, tmpfs: Callable[..., Path],
) -> None:
    # Not a byte left: the failure records and torch's error files cannot be written either.
    disk = tmpfs("48m")
    run_dir = disk / "run"
    app = _start(tmp_path, "full", run_dir, f"loop.total_env_steps={10**9}",
                 "loop.checkpoint_every=1")
    try:
        app.wait_until("a checkpoint", lambda: bool(_checkpoints(run_dir)))
        fill(disk)
        code = app.wait()
    finally:
        app.close()
    app.assert_all_ended()
    assert code == 2, app.describe()
    last = app.stderr.strip().splitlines()[-1]
    files = "|".join(re.escape(str(run_dir / f)) for f in ("metrics.csv", "logs/rank0.log",
                                                           "logs/rank1.log"))
    assert re.fullmatch(
        rf"error: rank [01]: no space left on device writing (?:{files}|"
        rf"{re.escape(str(run_dir / 'checkpoints'))}/ckpt_\d{{6}}\.pt; the last checkpoint is "
        rf"ckpt_\d{{6}}\.pt)", last), app.describe()
    assert "Traceback" not in app.stderr and "JSONDecodeError" not in app.stderr, app.describe()
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    rows = _metrics_rows(run_dir)
    assert [int(float(r["update"])) for r in rows] == list(range(1, len(rows) + 1))


@pytest.mark.e2e
def test_a_read_only_run_dir_is_named_before_any_rank_starts(
    tmp_path: Path, tmpfs: Callable[..., Path],
) -> None:
    disk = tmpfs("4m")
    (disk / "existing").mkdir()
    read_only(disk)
    for run_dir in (disk / "new", disk / "existing"):
        proc = run_app(*PPO_SMALL, f"hydra.run.dir={run_dir}")
        assert proc.returncode == 2, describe(proc)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: hydra.run.dir: "), describe(proc)
        assert str(run_dir) in lines[0] and "read-only file system" in lines[0].lower(), \
            describe(proc)
    assert [p.name for p in disk.iterdir()] == ["existing"]  # nothing was written, no rank ran
    assert not list((disk / "existing").iterdir())
