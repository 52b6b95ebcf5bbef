"""A ``--multirun`` sweep with one bad job ends before any job starts: one ``error:`` line that
names the job, its overrides, the field and the value, exit code 2, no job's folder, no process
left (run_app checks), for the basic launcher (the default) and the local submitit one. The
SLURM launcher's check, without a cluster: tests/unit/test_sweep_validation.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.apprun import describe, run_app

pytestmark = pytest.mark.e2e


def assert_refused(stderr: str, pattern: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(pattern, errors[0]), stderr
    assert "Traceback" not in stderr


def test_a_sweep_with_a_bad_seed_runs_no_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "layout=single", "seed=0,-1", f"hydra.sweep.dir={sweep}",
                   "loop.total_env_steps=512", "loop.hparams.num_envs=4", timeout=120)
    assert proc.returncode == 2, describe(proc)
    assert_refused(proc.stderr, r"error: sweep job #1 \(layout=single seed=-1 [^)]*\): seed: "
                                r"must be between 0 and \d+ .*, got -1")
    assert not (sweep / "0").exists() and not list(sweep.rglob("result.json"))
    # Fixed, the sweep runs into the same dir (a plan of each job: no rank starts).
    again = run_app("--multirun", "layout=single", "seed=0,1", "plan_only=true",
                    f"hydra.sweep.dir={sweep}", timeout=120)
    assert again.returncode == 0, describe(again)
    assert (sweep / "1" / "layout.txt").exists()


def test_a_local_submitit_sweep_with_a_bad_replay_capacity_submits_no_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "hydra/launcher=rlcomm_local", "loop=dqn", "layout=1t1r",
                   "loop.replay.capacity=100000,10", f"hydra.sweep.dir={sweep}", timeout=120)
    assert proc.returncode == 2, describe(proc)
    assert_refused(proc.stderr, r"error: sweep job #1 \(loop=dqn layout=1t1r "
                                r"loop.replay.capacity=10\): loop.replay.capacity: .*got 10")
    assert not (sweep / ".submitit").exists() and not (sweep / "0").exists()
