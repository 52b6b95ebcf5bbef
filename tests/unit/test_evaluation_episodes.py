"""Whole evaluation episodes on one process (app/runtime/evaluation/episodes.py), on real Gymnasium envs."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from app.loops.ppo.core import PPO, PPOSettings
from app.runtime.core.algorithm import Spaces
from app.runtime.envs.vector import EnvConfig
from app.runtime.evaluation.episodes import run_episodes
from app.runtime.models.transformer import TransformerActorCritic
from app.runtime.rollout.worker import Agent

pytestmark = pytest.mark.unit


def _ppo(env_id: str, normalize: bool = False) -> tuple[PPO, Agent, EnvConfig]:
    env = gym.make(env_id)
    spaces = Spaces(env.observation_space, env.action_space)
    env.close()
    torch.manual_seed(0)
    algorithm = PPO(PPOSettings(), spaces)
    cfg = EnvConfig(id=env_id, normalize_obs=normalize)
    return algorithm, Agent(algorithm.build(), spaces, cfg), cfg


def test_episodes_are_whole_seeded_and_greedy_by_default() -> None:
    algorithm, agent, env = _ppo("CartPole-v1")
    first = run_episodes(algorithm, agent, env, episodes=3, seed=7)
    # CartPole pays 1 per step until the episode ends: the return is the length.
    assert first.returns == [float(n) for n in first.lengths] and len(first.returns) == 3
    assert all(1 <= n <= 500 for n in first.lengths)
    # The same seed gives the same episodes; greedy actions use no randomness.
    assert run_episodes(algorithm, agent, env, episodes=3, seed=7) == first
    assert first.mean_return == pytest.approx(np.mean(first.returns))
    assert first.std_return == pytest.approx(np.std(first.returns))


def test_stochastic_episodes_sample_with_their_own_seed() -> None:
    algorithm, agent, env = _ppo("CartPole-v1")
    runs = [run_episodes(algorithm, agent, env, episodes=4, seed=s, deterministic=False)
            for s in (3, 3, 4)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_normalisation_statistics_stay_frozen() -> None:
    algorithm, agent, env = _ppo("Pendulum-v1", normalize=True)
    assert agent.obs_norm is not None
    agent.obs_norm.merge(agent.obs_norm.batch_moments(torch.randn(100, 3, dtype=torch.float64), (3,)))
    before = {k: v.clone() for k, v in agent.normalizers().items()}
    done = run_episodes(algorithm, agent, env, episodes=1, seed=0)
    assert done.lengths == [200]  # Pendulum ends only at its time limit
    assert all(torch.equal(before[k], v) for k, v in agent.normalizers().items())


class _Seen(TransformerActorCritic):
    """The transformer policy, keeping every window its greedy action was computed from."""

    windows: list[torch.Tensor]

    def greedy(self, obs: torch.Tensor) -> torch.Tensor:
        self.windows.append(obs.clone())
        return super().greedy(obs)


def test_a_history_policy_sees_the_episode_window_as_in_training() -> None:
    env = gym.make("CartPole-v1")
    spaces = Spaces(env.observation_space, env.action_space)
    env.close()
    torch.manual_seed(0)
    context = 4
    policy = _Seen(spaces, width=16, layers=1, heads=2, context=context)
    policy.windows = []
    cfg = EnvConfig(id="CartPole-v1")
    agent = Agent(policy, spaces, cfg, context=context)
    done = run_episodes(PPO(PPOSettings(), spaces), agent, cfg, episodes=2, seed=5)
    # The two episodes run side by side: one window per live episode and step.
    assert sum(len(w) for w in policy.windows) == sum(done.lengths)
    assert len(policy.windows) == max(done.lengths)
    for t, windows in enumerate(policy.windows):
        assert windows.shape == (sum(n > t for n in done.lengths), context, 5)
        real = min(t + 1, context)  # each episode starts over: padding, then real steps
        for window in windows:
            assert window[:, -1].tolist() == [0.0] * (context - real) + [1.0] * real
        if t and len(windows) == len(policy.windows[t - 1]):
            # The newest step of the last window is now one step older.
            assert torch.equal(windows[:, -2, :-1], policy.windows[t - 1][:, -1, :-1])
    again = _Seen(spaces, width=16, layers=1, heads=2, context=context)
    again.load_state_dict(policy.state_dict())
    again.windows = []
    assert run_episodes(PPO(PPOSettings(), spaces), Agent(again, spaces, cfg, context=context),
                        cfg, episodes=2, seed=5) == done
