"""A run dir belongs to one run: the lock and its rules, driving
app/launch/rundir.py in this process (two descriptors on one lock file conflict as two
processes do). Real runs that meet in one dir are tests/e2e/test_rundir.py."""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.api import RankEnv
from app.launch import rundir
from app.launch.rundir import LOCK_NAME, RunDirError, check_as_peer, claim, read_holder

pytestmark = pytest.mark.unit
KEY = "hydra.run.dir"
SINCE = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"


@pytest.fixture
def released() -> Iterator[None]:
    """Whatever a unit test took in this process is let go at its end."""
    yield
    for directory in list(rundir._held):
        rundir.release(directory)


def stale(directory: Path, run: str, *markers: str, plan_only: bool = False) -> None:
    """``directory`` as a run ``run`` that has ended left it (its lock free, its record kept)."""
    claim(directory, KEY, identity=run, plan_only=plan_only)
    for name in markers:
        if Path(name).suffix:  # result.json, metrics.csv
            (directory / name).write_text("x")
        else:  # .hydra, logs, checkpoints
            (directory / name).mkdir()
    rundir.release(directory)


def test_a_fresh_dir_is_taken_and_records_its_holder(tmp_path: Path, released: None) -> None:
    directory = tmp_path / "new" / "run"
    assert claim(directory, KEY, identity="run-a") is None
    record = json.loads((directory / LOCK_NAME).read_text())
    assert (record["run"], record["pid"], record["host"]) == ("run-a", os.getpid(),
                                                              socket.gethostname())
    assert record["kind"] == "run" and record["plan_only"] is False


def test_a_second_live_run_is_refused_naming_the_holder(tmp_path: Path, released: None) -> None:
    claim(tmp_path, KEY, identity="run-a")
    before = (tmp_path / LOCK_NAME).read_text()
    with pytest.raises(RunDirError) as err:
        claim(tmp_path, KEY, identity="run-b")
    assert re.fullmatch(
        rf"hydra\.run\.dir: {tmp_path} is in use by run run-a \(pid {os.getpid()} on "
        rf"{re.escape(socket.gethostname())} since {SINCE}\); wait for it to end, or choose "
        r"another hydra\.run\.dir", str(err.value)), err.value
    assert (tmp_path / LOCK_NAME).read_text() == before


def test_a_stale_lock_of_another_run_is_named_and_refused(tmp_path: Path, released: None) -> None:
    stale(tmp_path, "run-a", ".hydra", "metrics.csv", "checkpoints")
    before = (tmp_path / LOCK_NAME).read_text()
    with pytest.raises(RunDirError) as err:
        claim(tmp_path, KEY, identity="run-b", resumable=True)
    assert re.fullmatch(
        rf"hydra\.run\.dir: {tmp_path} holds an unfinished run \(stale lock of pid {os.getpid()} "
        rf"on {re.escape(socket.gethostname())} since {SINCE} \(run run-a\), no longer running\); "
        rf"to continue it, pass loop\.resume={tmp_path} with a new hydra\.run\.dir; to start "
        r"fresh, choose another hydra\.run\.dir", str(err.value)), err.value
    assert (tmp_path / LOCK_NAME).read_text() == before  # the refused run changed nothing


def test_the_same_run_continues_its_own_dir(tmp_path: Path, released: None) -> None:
    """An elastic restart, a requeued SLURM job, a host that rejoins: one identity, a free lock."""
    stale(tmp_path, "slurm-26.0", ".hydra", "checkpoints")
    continued = claim(tmp_path, KEY, identity="slurm-26.0")
    assert continued is not None and continued.run == "slurm-26.0"
    record = read_holder(tmp_path)
    assert record is not None and record.pid == os.getpid()


def test_a_finished_run_is_refused_even_to_its_own_job(tmp_path: Path, released: None) -> None:
    stale(tmp_path, "run-a", ".hydra", "result.json")
    for identity, resumable in (("run-b", True), ("run-a", False)):
        with pytest.raises(RunDirError) as err:
            claim(tmp_path, KEY, identity=identity, resumable=resumable)
        hint = rf"to continue it, pass loop\.resume={tmp_path} with a new hydra\.run\.dir; " \
            if resumable else ""
        assert re.fullmatch(
            rf"hydra\.run\.dir: {tmp_path} holds a finished run \(run run-a \(pid \d+ on \S+ since "
            rf"{SINCE}\)\); {hint}to start fresh, choose another hydra\.run\.dir",
            str(err.value)), err.value


def test_a_run_stopped_by_sigterm_goes_on_in_its_own_job_and_is_refused_to_others(
    tmp_path: Path, released: None
) -> None:
    """A preempted or requeued job's ranks were asked to stop: their result says so, and the
    same job continues from its newest checkpoint; any other run is told how to resume it."""
    stale(tmp_path, "slurm-27.0", ".hydra", "checkpoints")
    (tmp_path / "result.json").write_text(json.dumps({"status": "stopped"}))
    with pytest.raises(RunDirError, match=r"holds a run stopped by a signal \(run slurm-27\.0 "):
        claim(tmp_path, KEY, identity="run-b", resumable=True)
    continued = claim(tmp_path, KEY, identity="slurm-27.0")
    assert continued is not None and continued.run == "slurm-27.0"


def test_files_of_a_run_without_a_lock_are_refused_and_left_alone(
    tmp_path: Path, released: None
) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "metrics.csv").write_text("update\n1\n")
    (tmp_path / "logs").mkdir()
    with pytest.raises(RunDirError, match=r"holds files of an earlier run \(metrics\.csv, logs\)"):
        claim(tmp_path, KEY, identity="run-b")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "logs", "metrics.csv"]


def test_other_files_a_plan_or_a_refused_config_do_not_make_a_run(
    tmp_path: Path, released: None
) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's own file")
    assert claim(tmp_path / "mine", KEY, identity="run-a") is None
    plan = tmp_path / "plan"
    stale(plan, "run-p", ".hydra", plan_only=True)  # plan_only=true leaves .hydra and pictures
    assert claim(plan, KEY, identity="run-b") is None
    rundir.release(plan)
    refused = tmp_path / "typo"  # a config refused before launch: .hydra/ and no rank
    stale(refused, "run-t", ".hydra")
    assert claim(refused, KEY, identity="run-t2") is None
    stale(tmp_path / "real", "run-r", ".hydra", "checkpoints")  # a plan into a run's dir: refused
    with pytest.raises(RunDirError, match="holds an unfinished run"):
        claim(tmp_path / "real", KEY, identity="run-p2", plan_only=True)


def test_an_earlier_sweep_dir_is_refused(tmp_path: Path, released: None) -> None:
    claim(tmp_path, "hydra.sweep.dir", "sweep", identity="sweep-a")
    (tmp_path / "multirun.yaml").write_text("x")
    rundir.release(tmp_path)
    with pytest.raises(RunDirError) as err:
        claim(tmp_path, "hydra.sweep.dir", "sweep", identity="sweep-b")
    assert re.fullmatch(
        rf"hydra\.sweep\.dir: {tmp_path} holds an earlier sweep \(stale lock of pid \d+ on \S+ "
        rf"since {SINCE} \(run sweep-a\)\); to start fresh, choose another hydra\.sweep\.dir",
        str(err.value)), err.value


def test_ranks_other_than_0_follow_the_record(tmp_path: Path, released: None) -> None:
    # Nothing there yet: they wait for their rank 0 (which never comes here).
    with pytest.raises(RunDirError, match=r"empty: rank 0 did not take it within 0 s \(no lock "):
        check_as_peer(tmp_path / "empty", KEY, identity="job-1", timeout_s=0.2)
    assert not (tmp_path / "empty").exists()
    claim(tmp_path, KEY, identity="job-1")
    check_as_peer(tmp_path, KEY, identity="job-1")  # their own rank 0 holds it
    with pytest.raises(RunDirError, match=rf"{tmp_path}: rank 0 did not take it within 0 s \(it "
                       r"belongs to run job-1 \(pid"):
        check_as_peer(tmp_path, KEY, identity="job-2", timeout_s=0.2)
    (tmp_path / "logs").mkdir()
    rundir.release(tmp_path)
    with pytest.raises(RunDirError, match="holds an unfinished run"):
        check_as_peer(tmp_path, KEY, identity="job-2")
    unrecorded = tmp_path / "old"
    (unrecorded / "logs").mkdir(parents=True)
    with pytest.raises(RunDirError, match="holds files of an earlier run"):
        check_as_peer(unrecorded, KEY, identity="job-2")


def test_a_run_is_identified_alike_on_every_rank_and_attempt() -> None:
    from app.launch.environment import resolve_rank_env

    local = RankEnv("local")
    assert rundir.run_identity(local) == rundir.run_identity(local)
    assert rundir.run_identity(local).startswith("local-")
    step = {"SLURM_JOB_ID": "26", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "vm"}
    assert rundir.run_identity(resolve_rank_env(step)) == "slurm-26.0"
    requeued = resolve_rank_env({**step, "SLURM_RESTART_COUNT": "1"})
    assert rundir.run_identity(requeued) == "slurm-26.0" and requeued.restart_count == 1
    torchrun = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "1", "WORLD_SIZE": "2"}
    assert rundir.run_identity(resolve_rank_env(torchrun)) == "torchrun-abc"
