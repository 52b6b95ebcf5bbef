"""The SAC experiments (``+experiment=hopper_sac``, ``+experiment=halfcheetah_sac``) compose on
their own, select ``loop=sac`` and pass the checks before launch with CleanRL
``sac_continuous_action.py``'s replay choices (docs/off-policy.md)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from app.launch.planning import validate
from tests.helpers.apprun import REPO

pytestmark = pytest.mark.unit


def _composed(*overrides: str) -> DictConfig:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=False)
    validate(cfg)
    return cfg


@pytest.mark.parametrize(("experiment", "env_id"), [
    ("halfcheetah_sac", "HalfCheetah-v5"),
    ("hopper_sac", "Hopper-v5"),
])
def test_a_sac_experiment_alone_selects_sac_with_cleanrls_replay(experiment: str,
                                                                 env_id: str) -> None:
    cfg = _composed(f"+experiment={experiment}")
    loop = cfg.loop
    assert "policy_frequency" in loop.hparams  # SAC's settings: the experiment chose loop=sac
    assert loop.env.id == env_id
    assert (loop.env.normalize_obs, loop.env.normalize_reward) == (False, False)
    # CleanRL's buffer_size, batch_size, learning_starts and one batch per env step.
    replay = loop.replay
    assert (replay.capacity, replay.batch_size, replay.min_size) == (1_000_000, 256, 5000)
    assert replay.samples_per_insert == replay.batch_size
    assert (loop.hparams.policy_frequency, loop.hparams.tau, loop.hparams.gamma) == (2, 0.005, 0.99)
    assert (loop.hparams.q_lr, loop.hparams.policy_lr) == (1e-3, 3e-4)
    assert loop.total_env_steps == 1_000_000 and loop.stop_at_target is False


def test_naming_loop_sac_too_gives_the_same_config() -> None:
    alone = _composed("+experiment=halfcheetah_sac", "layout=single")
    named = _composed("loop=sac", "+experiment=halfcheetah_sac", "layout=single")
    assert alone.loop == named.loop
