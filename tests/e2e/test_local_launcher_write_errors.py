"""Write errors end a run in one line (docs/data-safety.md): a disk that fills while PPO runs
(also under sharded checkpoints), one with no room at all, a read-only run dir: exit code 2,
the file and the error named, nothing left running, the last checkpoint resumable and every
metrics.csv row written before the error whole. Each writer alone, and the launcher's line,
are tests/unit/test_local_launcher_write_errors.py.

The disks are real: small tmpfs mounts (root only; CI is root), always unmounted
(the ``tmpfs`` fixture, tests/conftest.py).
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.apprun import AppProcess, describe, run_app
from tests.helpers.disks import fill, read_only

pytestmark = pytest.mark.e2e


# A PPO run of 2 ranks (1 trainer, 1 rollout) that would go on for long; 256 env steps an update.
PPO_SMALL = ("layout=1t1r", "loop.hparams={num_envs:4,num_steps:64}", "loop.progress=false",
             "loop.target_return=1e9")
STEPS_PER_UPDATE = 4 * 64


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
