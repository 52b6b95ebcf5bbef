"""A run dir belongs to one run: real runs that meet in one dir.

These tests start ``python -m app`` (and torchrun) into dirs another run holds or used; the lock
and its rules, in this process, are tests/unit/test_rundir.py. The SLURM requeue that continues
its own dir is in tests/cluster/test_slurm.py (it needs the cluster fixture there).
"""

from __future__ import annotations

import re
import socket
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.launch import rundir
from app.launch.rundir import LOCK_NAME, read_holder
from tests.helpers.apprun import REPO, AppProcess, describe, read_result, run_app

SINCE = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"

WAIT_LOOP = '''
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class WaitFor:
    """Runs until the file ``release`` exists: a run that is alive for as long as a test wants."""

    release: str = ""

    def __call__(self, ctx, job):
        while not Path(self.release).exists():
            time.sleep(0.05)
        return {}
'''


@pytest.fixture
def waiting(tmp_path: Path) -> Iterator[Callable[..., AppProcess]]:
    """``waiting(name, run_dir, *overrides)``: a one-rank run that lasts until
    ``<tmp_path>/<name>.release`` exists; killed (and reported as a survivor) at teardown."""
    package = tmp_path / "rundirpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "loops.py").write_text(textwrap.dedent(WAIT_LOOP))
    apps: list[AppProcess] = []

    def start(name: str, run_dir: Path, *overrides: str) -> AppProcess:
        settings = ("layout=single", "loop=custom", "loop._target_=rundirpkg.loops.WaitFor",
                    f"+loop.release={tmp_path / f'{name}.release'}", *overrides)
        app = AppProcess(name, tmp_path, settings, run_dir, user_env(tmp_path), ())
        apps.append(app)
        return app

    yield start
    for app in apps:
        app.close()


def user_env(tmp_path: Path) -> dict[str, str]:
    return {"PYTHONPATH": f"{REPO}:{tmp_path}"}


def holder(run_dir: Path) -> rundir.Holder:
    record = read_holder(run_dir)
    assert record is not None, f"no lock record in {run_dir}"
    return record


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run dir, by relative path (the lock record included)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file()}


@pytest.mark.e2e
def test_a_second_live_run_into_the_same_dir_is_refused_and_the_first_is_untouched(
    tmp_path: Path, waiting: Callable[..., AppProcess]
) -> None:
    run_dir = tmp_path / "shared"
    first = waiting("first", run_dir, "seed=1")
    first.wait_until_training(world_size=1)
    before = snapshot(run_dir)
    second = run_app("layout=single", "loop=custom", "loop._target_=rundirpkg.loops.WaitFor",
                     f"+loop.release={tmp_path / 'first.release'}", "seed=2",
                     f"hydra.run.dir={run_dir}", cwd=tmp_path, env=user_env(tmp_path))
    assert second.returncode == 2, describe(second)
    host = re.escape(socket.gethostname())
    assert len(error_lines(second.stderr)) == 1, describe(second)
    assert re.fullmatch(
        rf"error: hydra\.run\.dir: {run_dir} is in use by run local-\w+ \(pid {first.pid} on "
        rf"{host} since {SINCE}\); wait for it to end, or choose another hydra\.run\.dir",
        second.stderr.strip()), describe(second)
    after = snapshot(run_dir)
    assert {k: v for k, v in after.items() if k.startswith((".hydra", LOCK_NAME))} == \
        {k: v for k, v in before.items() if k.startswith((".hydra", LOCK_NAME))}
    (tmp_path / "first.release").touch()
    assert first.wait() == 0, first.describe()
    first.assert_all_ended()
    assert read_result(run_dir)["status"] == "ok"
    assert "seed=1" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "seed: 1" in (run_dir / ".hydra" / "config.yaml").read_text()


@pytest.mark.e2e
def test_a_stale_lock_is_named_after_its_run_was_killed(
    tmp_path: Path, waiting: Callable[..., AppProcess]
) -> None:
    run_dir = tmp_path / "killed"
    first = waiting("first", run_dir)
    first.wait_until_training(world_size=1)
    first.close()  # SIGKILL to its whole session: no handler runs, the lock file stays
    before = snapshot(run_dir)
    again = run_app("layout=single", "loop=commcheck", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert again.returncode == 2, describe(again)
    assert len(error_lines(again.stderr)) == 1, describe(again)
    assert re.fullmatch(
        rf"error: hydra\.run\.dir: {run_dir} holds an unfinished run \(stale lock of pid "
        rf"{first.pid} on {re.escape(socket.gethostname())} since {SINCE} \(run local-\w+\), no "
        r"longer running\); to start fresh, choose another hydra\.run\.dir",
        again.stderr.strip()), describe(again)
    assert snapshot(run_dir) == before


@pytest.mark.e2e
def test_a_finished_run_dir_is_refused_with_how_to_resume_it(tmp_path: Path) -> None:
    run_dir, resumed = tmp_path / "done", tmp_path / "resumed"
    ppo = ("layout=1t1r", "loop.hparams={num_envs:4,num_steps:64}", "loop.progress=false",
           "loop.target_return=1e9", "loop.checkpoint_every=2")
    first = run_app(*ppo, f"loop.total_env_steps={4 * 256}", f"hydra.run.dir={run_dir}",
                    cwd=tmp_path)
    assert first.returncode == 0, describe(first)
    before = snapshot(run_dir)
    again = run_app(*ppo, f"loop.total_env_steps={8 * 256}", f"hydra.run.dir={run_dir}",
                    cwd=tmp_path)
    assert again.returncode == 2, describe(again)
    assert error_lines(again.stderr) == [
        f"error: hydra.run.dir: {run_dir} holds a finished run ({holder(run_dir).describe()}); "
        f"to continue it, pass loop.resume={run_dir} with a new hydra.run.dir; to start fresh, "
        "choose another hydra.run.dir"], describe(again)
    assert snapshot(run_dir) == before  # no file replaced, no checkpoint added
    # What the line says works.
    follow = run_app(*ppo, f"loop.total_env_steps={8 * 256}", f"loop.resume={run_dir}",
                     f"hydra.run.dir={resumed}", cwd=tmp_path)
    assert follow.returncode == 0, describe(follow)
    assert {r["result"]["updates"] for r in read_result(resumed)["ranks"]} == {8}
    assert snapshot(run_dir) == before


@pytest.mark.e2e
def test_a_multirun_into_a_used_sweep_dir_is_refused(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    commcheck = ("--multirun", "layout=1t1r", "loop=commcheck", "loop.bandwidth_bytes=65536",
                 "seed=0,1", f"hydra.sweep.dir={sweep}")
    first = run_app(*commcheck, cwd=tmp_path)
    assert first.returncode == 0, describe(first)
    before = snapshot(sweep)
    again = run_app(*commcheck, cwd=tmp_path)
    assert again.returncode == 2, describe(again)
    assert len(error_lines(again.stderr)) == 1, describe(again)
    assert re.fullmatch(
        rf"error: hydra\.sweep\.dir: {sweep} holds an earlier sweep \(stale lock of pid \d+ on "
        rf"\S+ since {SINCE} \(run local-\w+\)\); to start fresh, choose another "
        r"hydra\.sweep\.dir", again.stderr.strip()), describe(again)
    assert "sweep summary" not in again.stdout  # the earlier sweep's report was not redone
    assert snapshot(sweep) == before


@pytest.mark.e2e
def test_torchrun_ranks_refuse_a_dir_another_run_finished(tmp_path: Path) -> None:
    """Every rank of a joined job checks before it writes: rank 0 takes the lock, the others
    read its record; none touches the first run's files."""
    run_dir = tmp_path / "done"
    commcheck = ("layout=1t1r", "loop=commcheck", "loop.bandwidth_bytes=65536",
                 f"hydra.run.dir={run_dir}")
    first = run_app(*commcheck, cwd=tmp_path)
    assert first.returncode == 0, describe(first)
    before = snapshot(run_dir)
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "app")
    again = run_app(*commcheck, cwd=tmp_path, module=torchrun, env={"PYTHONPATH": str(REPO)},
                    timeout=180)
    assert again.returncode != 0, describe(again)
    errors = {line for line in again.stderr.splitlines() if line.startswith("error:")}
    assert errors == {
        f"error: hydra.run.dir: {run_dir} holds a finished run ({holder(run_dir).describe()}); "
        "to start fresh, choose another hydra.run.dir"}, describe(again)
    assert snapshot(run_dir) == before


@pytest.mark.e2e
def test_the_default_run_dir_is_the_one_that_was_locked(tmp_path: Path) -> None:
    """The default name holds the time: resolved once, where the lock is taken, and used."""
    proc = run_app("layout=single", "loop=commcheck", "loop.bandwidth_bytes=65536", cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    runs = [p for p in (tmp_path / "outputs" / "runs").rglob("*") if p.is_dir()
            and p.parent.parent == tmp_path / "outputs" / "runs"]
    assert len(runs) == 1, runs
    assert holder(runs[0]).run.startswith("local-")
    assert (runs[0] / ".hydra").is_dir() and read_result(runs[0])["status"] == "ok"
