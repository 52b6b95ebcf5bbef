"""Ape-X's per-collector epsilon for DQN (``loop.hparams.exploration=apex``): the formula
against Horgan et al. 2018's, two collectors acting with their own epsilons, and the settings'
range checks before launch (the e2e proof that ranks learn their index:
tests/e2e/test_apex_exploration.py)."""

from __future__ import annotations

import pytest
import torch
from gymnasium import spaces as gym_spaces
from hydra import compose, initialize_config_dir

from app.errors import ConfigError
from app.launch.planning import validate
from app.loops.dqn import DQN, DQNSettings, apex_epsilon
from app.runtime import Spaces
from tests.helpers.apprun import REPO

pytestmark = pytest.mark.unit


def test_collector_i_of_n_holds_epsilon_to_the_one_plus_alpha_i_over_n_minus_one() -> None:
    eps, alpha = 0.4, 7.0
    assert apex_epsilon(eps, alpha, 0, 8) == pytest.approx(0.4)
    assert apex_epsilon(eps, alpha, 7, 8) == pytest.approx(0.4**8)
    assert apex_epsilon(eps, alpha, 3, 8) == pytest.approx(0.4**4)  # 1 + 7 * 3 / 7
    assert apex_epsilon(eps, alpha, 1, 3) == pytest.approx(0.4**4.5)
    assert apex_epsilon(eps, alpha, 0, 1) == pytest.approx(0.4)  # a lone collector
    spread = [apex_epsilon(eps, alpha, i, 5) for i in range(5)]
    assert spread == sorted(spread, reverse=True)


def _explored(algorithm: DQN, module: torch.nn.Module, obs: torch.Tensor) -> float:
    """The share of actions that differ from the greedy one."""
    actions, _ = algorithm.act(module, obs, torch.Generator().manual_seed(0))
    return float((actions != module(obs).argmax(-1)).float().mean())  # type: ignore[operator]


def test_two_collectors_act_with_their_own_epsilons() -> None:
    spaces = Spaces(gym_spaces.Box(-1, 1, (4,)), gym_spaces.Discrete(2))
    settings = DQNSettings(exploration="apex")
    torch.manual_seed(0)
    first, second = DQN(settings, spaces), DQN(settings, spaces)
    module = first.build()
    module.epsilon.fill_(1.0)  # type: ignore[operator]  (the schedule's: unused by apex)
    first.set_collector(0, 2)
    second.set_collector(1, 2)
    assert first.collector_epsilon == pytest.approx(0.4)
    assert second.collector_epsilon == pytest.approx(0.4**8)
    obs = torch.randn(20_000, 4)
    # A random action differs from the greedy one half the time with 2 actions.
    assert _explored(first, module, obs) == pytest.approx(0.2, abs=0.015)
    assert _explored(second, module, obs) < 0.003
    # anneal (the default) keeps the schedule's epsilon, whichever collector acts.
    annealed = DQN(DQNSettings(), spaces)
    annealed.set_collector(1, 2)
    assert _explored(annealed, module, obs) == pytest.approx(0.5, abs=0.015)


def _validate(*overrides: str) -> None:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        validate(compose("config", overrides=["loop=dqn", *overrides]))


@pytest.mark.parametrize(("override", "line"), [
    ("loop.hparams.exploration=boltzmann",
     "loop.hparams.exploration: must be one of anneal, apex, got boltzmann"),
    ("loop.hparams.apex_epsilon=1.5", "loop.hparams.apex_epsilon: must be in [0, 1], got 1.5"),
    ("loop.hparams.apex_alpha=-1", "loop.hparams.apex_alpha: must be >= 0, got -1.0"),
])
def test_bad_exploration_settings_are_one_line_before_launch(override: str, line: str) -> None:
    with pytest.raises(ConfigError) as failure:
        _validate(override)
    assert str(failure.value) == line


def test_apex_exploration_passes_its_checks() -> None:
    _validate("loop.hparams.exploration=apex")
