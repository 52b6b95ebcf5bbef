"""The deterministic action every shipped policy gives through ``Algorithm.greedy`` (the one
evaluation and export use): a categorical's most probable action, a Gaussian's mean."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces as gym_spaces
from torch import nn

from app.loops.ppo.core import PPO, PPOSettings
from app.loops.vtrace.core import VTrace, VTraceSettings
from app.runtime.core.algorithm import Algorithm, AlgorithmSettings, Spaces
from app.runtime.models.actor_critic import ActorCritic
from examples.reinforce import Reinforce, ReinforceSettings
from tests.helpers.transformer_inputs import BOX, DISCRETE, make_model, random_windows

pytestmark = pytest.mark.unit

VECTOR = gym_spaces.Box(-1.0, 1.0, (5,), np.float32)
SHIPPED = [(PPO, PPOSettings), (VTrace, VTraceSettings), (Reinforce, ReinforceSettings)]


@pytest.mark.parametrize(("algorithm", "settings"), SHIPPED, ids=["ppo", "vtrace", "reinforce"])
def test_a_discrete_policy_acts_with_its_most_probable_action(
    algorithm: type[Algorithm], settings: type[AlgorithmSettings]
) -> None:
    torch.manual_seed(0)
    algo = algorithm(settings(), Spaces(VECTOR, gym_spaces.Discrete(4)))
    module = algo.build()
    obs = torch.randn(64, 5)
    with torch.no_grad():
        action = algo.greedy(module, obs)
        logits = module.actor(obs)  # type: ignore[operator]
    assert action.dtype == torch.int64 and action.shape == (64,)
    assert torch.equal(action, logits.argmax(-1))
    # Greedy, not sampled: the same every time, and what sampling picks most often.
    assert torch.equal(algo.greedy(module, obs), action)


@pytest.mark.parametrize(("algorithm", "settings"), SHIPPED, ids=["ppo", "vtrace", "reinforce"])
def test_a_gaussian_policy_acts_with_its_mean_in_the_action_shape(
    algorithm: type[Algorithm], settings: type[AlgorithmSettings]
) -> None:
    torch.manual_seed(0)
    box = gym_spaces.Box(-1.0, 1.0, (2, 3), np.float32)
    algo = algorithm(settings(), Spaces(VECTOR, box))
    module = algo.build()
    with torch.no_grad():
        module.actor_logstd.fill_(-20.0)  # type: ignore[operator]  # a near-point Gaussian
        obs = torch.randn(32, 5)
        action = algo.greedy(module, obs)
        sampled, _, _ = module.act(obs, torch.Generator().manual_seed(1))  # type: ignore[operator]
    assert action.shape == (32, 2, 3) and action.dtype == torch.float32
    assert torch.equal(action, module.actor(obs).reshape(32, 2, 3))  # type: ignore[operator]
    torch.testing.assert_close(sampled, action)  # the samples collapse onto the mean


@pytest.mark.parametrize("spaces", [DISCRETE, BOX], ids=["discrete", "box"])
def test_the_transformer_policy_acts_greedily_too(spaces: Spaces) -> None:
    torch.manual_seed(0)
    model = make_model(spaces)
    windows = random_windows(1, 6)[0]
    with torch.no_grad():
        action = model.greedy(windows)
        dist = model._dist(model._features(windows))
    want = dist.logits.argmax(-1) if spaces is DISCRETE else dist.loc.reshape(6, 2, 2)
    assert torch.equal(action, want)


def test_a_module_without_greedy_is_one_clear_error() -> None:
    algo = PPO(PPOSettings(), Spaces(VECTOR, gym_spaces.Discrete(2)))
    with pytest.raises(NotImplementedError, match=r"PPO.greedy: Linear has no greedy\(obs\)"):
        algo.greedy(nn.Linear(5, 2), torch.zeros(1, 5))
    assert isinstance(algo.build(), ActorCritic)
