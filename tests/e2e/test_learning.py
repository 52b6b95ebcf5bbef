"""Tests that learn: PPO on the runtime reaches a stated return within a bounded budget, for
discrete actions (CartPole-v1, Acrobot-v1), continuous actions (Pendulum-v1) and image
observations (the synthetic env of tests/helpers/image_env.py), on a layout with rollout ranks (2t2r: two DDP
trainers, two rollout ranks) and on layout=single (one process).

Each env's settings, target and budget live in its experiment config (conf/experiment/*.yaml;
CartPole is the default run), whose comments give the env steps seeds took on each layout.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import pytest
from omegaconf import OmegaConf

from tests.helpers.apprun import describe, metrics, read_result, run_app

pytestmark = pytest.mark.e2e

SEED = 1
# A run past this is stuck: each takes 10-40 s on a busy 2-core machine, the budget bounds it.
TIMEOUT_S = 240


class Learning(NamedTuple):
    overrides: tuple[str, ...]  # what picks the env (none: the default run, CartPole)
    env_id: str
    target_return: float  # the stated return, as the run's config states it
    budget: int  # loop.total_env_steps


LEARNING = {
    "cartpole": Learning((), "CartPole-v1", 475, 400_000),  # the registered reward_threshold
    "acrobot": Learning(("+experiment=acrobot",), "Acrobot-v1", -100, 200_000),
    "pendulum": Learning(("+experiment=pendulum",), "Pendulum-v1", -400, 200_000),
    "image": Learning(("+experiment=image",), "RlcommImage-v0", 7.5, 30_000),
}
WORLD_SIZE = {"2t2r": 4, "single": 1}


@pytest.mark.parametrize("layout", ["2t2r", "single"])
@pytest.mark.parametrize("env", list(LEARNING))
def test_ppo_learns_to_the_stated_return_within_the_budget(
    env: str, layout: str, tmp_path: Path
) -> None:
    case = LEARNING[env]
    proc = run_app(
        *case.overrides, f"layout={layout}", f"seed={SEED}", "loop.progress=false",
        "loop.checkpoint_every=0", f"hydra.run.dir={tmp_path}", timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, describe(proc)

    config = OmegaConf.load(tmp_path / ".hydra" / "config.yaml")
    assert config.loop.env.id == case.env_id
    assert config.loop.total_env_steps == case.budget
    result = read_result(tmp_path)
    assert result["world_size"] == WORLD_SIZE[layout]
    summary = result["summary"]
    assert summary["target_return"] == case.target_return  # the run's own stop rule, as stated
    assert summary["solved"], describe(proc)  # reached the target within the budget
    assert summary["final_mean_return"] >= case.target_return
    assert summary["env_steps_to_target"] <= case.budget
    assert f"solved: mean return of the last 20 episodes reached {case.target_return:g}" in (
        proc.stdout + proc.stderr
    )
    first = metrics(tmp_path)[0]
    if env == "pendulum":
        # Continuous actions: the first update's policy entropy is a 1-D Gaussian's with std ~1
        # (the state-independent log-std starts at 0), 0.5 * ln(2 pi e) = 1.42; a categorical
        # over Pendulum-sized action sets (2 or 3) has at most ln 3 = 1.10.
        assert first["entropy"] == pytest.approx(0.5 * math.log(2 * math.pi * math.e), abs=0.1)
        assert first["mean_return"] < -700  # it started far below: a random policy scores ~-1200
