"""``python -m app loop=sac`` as a user runs it: SAC learns Pendulum-v1 on one rank within a
short budget, runs on 2t2r (two DDP trainers, rollout ranks) and ends, and SAC on
a discrete env is one line and exit 2 before any rank starts (docs/off-policy.md)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from app.runtime.replay.offpolicy import REPLAY_FIGURES
from tests.helpers.apprun import describe, metrics, read_result, run_app

pytestmark = pytest.mark.e2e

QUIET = ("loop.progress=false", "loop.checkpoint_every=0")
# A smaller SAC than CleanRL's, so that learning fits a test: 64-64 networks, batches of 128,
# one batch per env step (CleanRL's ratio) after 1,000 uniform random steps.
SMALL = ("loop.hparams.hidden_sizes=[64,64]", "loop.replay.batch_size=128",
         "loop.replay.samples_per_insert=128", "loop.replay.tolerance=256",
         "loop.replay.min_size=1000")


def test_sac_learns_pendulum_on_one_rank(tmp_path: Path) -> None:
    # A uniform random policy scores about -1200 per Pendulum episode; -500 over the last 8
    # episodes needs a policy that swings the pendulum up.
    proc = run_app("loop=sac", "layout=single", "seed=1", "loop.progress=false", *SMALL,
                   "loop.total_env_steps=10000", "loop.window=8", "loop.target_return=-500",
                   f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    rank = read_result(tmp_path)["ranks"][0]["result"]
    assert rank["reached_target"], (rank["mean_return_last_window"], rank["env_steps"])
    rows = metrics(tmp_path)
    assert set(REPLAY_FIGURES) | {"q_loss", "actor_loss", "alpha", "entropy"} <= set(rows[0])
    returns = [r["mean_return"] for r in rows if not math.isnan(r["mean_return"])]
    assert returns[0] < -700, returns  # the first episodes: uniform random actions
    assert rows[0]["learner_wait"] == 1.0  # nothing learnt before min_size
    learnt = [r for r in rows if not math.isnan(r["alpha"])]
    assert learnt and all(0 < r["alpha"] < 1 for r in learnt)  # tuned down from 1 (log 0)
    # The greedy policy (the scaled tanh of the mean) evaluates and exports from the checkpoint.
    export = tmp_path / "policy.pt2"
    evaluation = run_app(str(tmp_path), "--episodes", "5", "--export", str(export),
                         module=(sys.executable, "-m", "app.evaluate"))
    assert evaluation.returncode == 0, describe(evaluation)
    greedy = json.loads((sorted((tmp_path / "eval").iterdir())[-1] / "result.json").read_text())
    assert greedy["return_mean"] > -800, greedy  # uniform random play: about -1200
    actions = torch.export.load(str(export)).module()(torch.randn(7, 3))
    assert actions.shape == (7, 1) and bool((actions.abs() <= 2.0).all())  # Pendulum's Box
    # Called as a user would, outside torch.no_grad(): the actions record no autograd.
    assert not actions.requires_grad and actions.grad_fn is None, actions


def test_sac_on_2t2r_runs_two_trainers_and_ends(tmp_path: Path) -> None:
    proc = run_app("loop=sac", "layout=2t2r", "seed=1", *QUIET, *SMALL, "loop.replay.min_size=256",
                   "loop.total_env_steps=1536", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    ranks = read_result(tmp_path)["ranks"]
    assert len(ranks) == 4
    trainers = [r["result"] for r in ranks if "trainer" in r["result"]["role"]]
    assert len(trainers) == 2
    # DDP kept the two trainers' weights equal through the Q and actor steps.
    assert trainers[0]["param_checksum"] == pytest.approx(trainers[1]["param_checksum"],
                                                          rel=1e-6)
    assert metrics(tmp_path)[-1]["replay_samples"] > 0


def test_sac_on_a_discrete_env_is_one_line_and_exit_2_before_launch(tmp_path: Path) -> None:
    proc = run_app("loop=sac", "loop.env.id=CartPole-v1", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, describe(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: loop.env.id: CartPole-v1: action space Discrete(2) is "
                           "discrete: SAC needs a Box"), last
    assert not (tmp_path / "logs").exists()  # no rank started
