"""The env's spaces are probed once per run: one env built by the process that validates for
every rank (rank 0 under torchrun, the launcher under ``python -m app``); a trainer builds none,
a rollout rank only the envs it steps. Counted by an env factory that records each construction
per process (tests/helpers/counting_env.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.apprun import REPO, describe, read_result, run_app
from tests.helpers.counting_env import constructions

pytestmark = pytest.mark.e2e

NUM_ENVS = 2
TINY_PPO = ("loop.progress=false", f"loop.hparams.num_envs={NUM_ENVS}",
            "loop.hparams.num_steps=32", "loop.hparams.num_minibatches=1",
            "loop.total_env_steps=256", "loop.eval_every=0", "loop.checkpoint_every=0",
            "loop.env._target_=tests.helpers.counting_env.make_counting_env")


def test_under_torchrun_rank_0_probes_the_env_and_no_trainer_builds_one(tmp_path: Path) -> None:
    counts = tmp_path / "counts"
    counts.mkdir()
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "4", "-m", "app")
    proc = run_app("layout=2t2r", *TINY_PPO, f"+loop.env.kwargs.count_dir={counts}",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, module=torchrun,
                   env={"PYTHONPATH": str(REPO)}, timeout=240)
    assert proc.returncode == 0, describe(proc)
    assert read_result(tmp_path / "run")["world_size"] == 4
    # Rank 0 (a trainer) probed; rank 1 (the other trainer) built none; ranks 2 and 3 (the
    # rollout ranks) built the envs they step, and no env to probe.
    assert constructions(counts) == {"rank0": 1, "rank2": NUM_ENVS, "rank3": NUM_ENVS}


def test_the_local_launcher_probes_the_env_and_no_trainer_builds_one(tmp_path: Path) -> None:
    counts = tmp_path / "counts"
    counts.mkdir()
    proc = run_app("layout=1t1r", *TINY_PPO, f"+loop.env.kwargs.count_dir={counts}",
                   f"hydra.run.dir={tmp_path / 'run'}", timeout=180)
    assert proc.returncode == 0, describe(proc)
    assert constructions(counts) == {"launcher": 1, "rank1": NUM_ENVS}


def test_under_torchrun_an_env_that_cannot_be_built_is_rank_0s_one_line(tmp_path: Path) -> None:
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "app")
    proc = run_app("layout=1t1r", "+loop.env.kwargs.foo=1", cwd=tmp_path, module=torchrun,
                   env={"PYTHONPATH": str(REPO)}, timeout=180)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # Only rank 0 builds the env; torchrun's agent stops rank 1, which waits for it.
    assert errors == ["error: loop.env.kwargs: CartPole-v1 rejects {'foo': 1}: CartPoleEnv."
                      "__init__() got an unexpected keyword argument 'foo'"], describe(proc)
    assert not list(tmp_path.glob("outputs/runs/*/result.json"))
