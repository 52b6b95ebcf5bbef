"""Whole episodes of a policy on fresh environments, on one process: what evaluation measures.

The agent's normalisation statistics are used as they are and never updated (frozen), and the
action is :meth:`Algorithm.greedy`'s unless ``deterministic`` is false.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.runtime.algorithm import Algorithm
from app.runtime.envs import EnvConfig, make_env
from app.runtime.history import ObsHistory
from app.runtime.worker import Agent


@dataclass(frozen=True)
class Episodes:
    """The undiscounted return and the length of each episode, in the order they ran."""

    returns: list[float]
    lengths: list[int]

    @property
    def mean_return(self) -> float:
        return statistics.fmean(self.returns)

    @property
    def std_return(self) -> float:
        return statistics.pstdev(self.returns)

    @property
    def mean_length(self) -> float:
        return statistics.fmean(self.lengths)


def run_episodes(
    algorithm: Algorithm[Any], agent: Agent, env: EnvConfig, episodes: int, seed: int,
    deterministic: bool = True,
) -> Episodes:
    """Run ``episodes`` episodes, episode ``i`` on a fresh env reset with ``seed + i``.

    Stochastic actions are sampled with a generator seeded with ``seed``. A policy with a
    history (``agent.context``) sees the episode's window, as it does in training.
    """
    generator = torch.Generator().manual_seed(seed)
    returns: list[float] = []
    lengths: list[int] = []
    for i in range(episodes):
        total, length = _one_episode(algorithm, agent, env, seed + i, deterministic, generator)
        returns.append(total)
        lengths.append(length)
    return Episodes(returns, lengths)


def _one_episode(algorithm: Algorithm[Any], agent: Agent, env_cfg: EnvConfig, seed: int,
                 deterministic: bool, generator: torch.Generator) -> tuple[float, int]:
    env = make_env(env_cfg.id, env_cfg._target_, dict(env_cfg.kwargs))
    low = getattr(env.action_space, "low", None)
    high = getattr(env.action_space, "high", None)
    image = np.dtype(env.observation_space.dtype) == np.uint8
    try:
        obs, _ = env.reset(seed=seed)
        history = (ObsHistory(1, agent.context, math.prod(env.observation_space.shape or ()))
                   if agent.context else None)
        total, length, done = 0.0, 0, False
        while not done:
            raw = torch.as_tensor(np.asarray(obs)[None],
                                  dtype=torch.uint8 if image else torch.float32)
            with torch.no_grad():
                if history is None:
                    seen = agent.observe(raw)
                else:  # the episode's window, as a collector keeps it
                    if length == 0:
                        history.reset(raw.reshape(1, -1))
                    else:
                        history.push(raw.reshape(1, -1), torch.zeros(1))
                    seen = agent.observe_window(history.window())
                action = (algorithm.greedy(agent.net, seen) if deterministic
                          else algorithm.act(agent.net, seen, generator)[0])
            taken = action[0].numpy()
            if low is not None:
                taken = np.clip(taken, low, high)
            obs, reward, terminated, truncated, _ = env.step(taken)
            total += float(reward)
            length += 1
            done = bool(terminated or truncated)
        return total, length
    finally:
        env.close()
