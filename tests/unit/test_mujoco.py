"""MuJoCo continuous control (docs/mujoco.md), before launch: each experiment config composes
and validates with CleanRL's choices, and so does every job of the layout sweep. Runs that
learn and resume are tests/e2e/test_mujoco.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from app.launch.planning import validate
from tests.helpers.apprun import REPO

pytestmark = pytest.mark.unit


EXPERIMENTS = {"hopper": "Hopper-v5", "halfcheetah": "HalfCheetah-v5", "walker2d": "Walker2d-v5"}


def composed(*overrides: str, hydra: bool = False) -> Any:
    """The app's config as ``python -m app`` composes it (schemas registered); with ``hydra``,
    Hydra's own node too (the sweeper's parameters)."""
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_each_experiment_composes_and_validates_with_cleanrls_choices(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Building HalfCheetah-v5 (mujoco 4) writes a deprecation warning to MUJOCO_LOG.TXT in the
    # working directory: not into the checkout.
    monkeypatch.chdir(tmp_path)
    cfg = composed(f"+experiment={name}")
    plan = validate(cfg)  # what python -m app checks before any rank starts (spaces included)
    # The experiment's own layout and compile setting, measured fastest to 1M on 2 cores: 1t2r
    # (one trainer, two rollout ranks), the update compiled by Inductor.
    assert (plan.world_size, plan.trainers, plan.rollouts) == (3, (0,), (1, 2))
    loop = cfg.loop
    assert loop.compile == "inductor"
    assert loop.env.id == EXPERIMENTS[name]
    assert loop.env.normalize_obs and loop.env.normalize_reward
    assert loop.total_env_steps == 1_000_000
    # The budget decides: the target (null: the env's registered reward_threshold) is noted
    # when reached, the run goes on.
    assert loop.target_return is None and loop.stop_at_target is False
    hp = loop.hparams
    assert (hp.gamma, hp.gae_lambda, hp.lr, hp.anneal_lr, hp.update_epochs) == (
        0.99, 0.95, 3e-4, True, 10)
    assert (hp.clip_coef, hp.ent_coef, hp.vf_coef, hp.max_grad_norm) == (0.2, 0.0, 0.5, 0.5)
    assert hp.anneal_env_steps == loop.total_env_steps  # anneals over whatever budget is set
    longer = composed(f"+experiment={name}", "loop.total_env_steps=3000000")
    assert longer.loop.hparams.anneal_env_steps == 3_000_000
    # Several envs per collecting rank: 2,048 env steps per update (CleanRL's), in minibatches
    # of 256 for the one trainer.
    assert hp.num_envs * hp.num_steps * len(plan.rollouts) == 2048
    assert 2048 // hp.num_minibatches == 256
    # An explicit layout and compile setting still win.
    mine = composed(f"+experiment={name}", "layout=2t2r", "loop.compile=off")
    assert validate(mine).trainers == (0, 1) and mine.loop.compile == "off"


def test_the_layout_sweep_composes_and_every_job_validates() -> None:
    cfg = composed("+experiment=mujoco_layouts", hydra=True)
    params = {k: str(v).split(",") for k, v in cfg.hydra.sweeper.params.items()}
    assert params == {"layout": ["single", "1t1r", "1t3r", "2t2r"],
                      "loop.max_staleness": ["0", "1"], "seed": ["0", "1", "2"]}
    assert cfg.sweep.rank_by == "time_to_target_s"
    for layout in params["layout"]:
        for staleness in params["loop.max_staleness"]:
            job = composed("+experiment=mujoco_layouts", f"layout={layout}",
                           f"loop.max_staleness={staleness}")
            validate(job)
            loop = job.loop
            assert loop.env.id == "Hopper-v5"
            assert loop.target_return == 1000 and loop.stop_at_target is False
            # The first part of the 1M-step schedule: the learning rate anneals over 1M.
            assert loop.hparams.anneal_env_steps == 1_000_000
            assert loop.total_env_steps < 1_000_000
            assert loop.compile == "off"  # as the sweep was measured: the layouts alone differ
