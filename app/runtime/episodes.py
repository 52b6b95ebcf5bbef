"""Whole episodes of a policy on fresh environments, on one process: what evaluation measures.

The agent's normalisation statistics are used as they are and never updated (frozen), and the
action is :meth:`Algorithm.greedy`'s unless ``deterministic`` is false.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.runtime.algorithm import Algorithm
from app.runtime.envs import EnvConfig, make_env
from app.runtime.history import ObsHistory
from app.runtime.video import EpisodeVideo, frame, make_rendering_env
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
    deterministic: bool = True, videos: Sequence[Path] = (),
) -> Episodes:
    """Run ``episodes`` episodes, episode ``i`` on a fresh env reset with ``seed + i``; episode
    ``i`` is also recorded as the mp4 ``videos[i]`` while there is one (app/runtime/video.py).

    Stochastic actions are sampled with a generator seeded with ``seed``. A policy with a
    history (``agent.context``) sees the episode's window, as it does in training.
    """
    generator = torch.Generator().manual_seed(seed)
    returns: list[float] = []
    lengths: list[int] = []
    for i in range(episodes):
        video = videos[i] if i < len(videos) else None
        total, length = _one_episode(algorithm, agent, env, seed + i, deterministic, generator,
                                     video)
        returns.append(total)
        lengths.append(length)
    return Episodes(returns, lengths)


def _one_episode(algorithm: Algorithm[Any], agent: Agent, env_cfg: EnvConfig, seed: int,
                 deterministic: bool, generator: torch.Generator,
                 video: Path | None) -> tuple[float, int]:
    env = (make_rendering_env(env_cfg) if video is not None
           else make_env(env_cfg.id, env_cfg._target_, dict(env_cfg.kwargs)))
    low = getattr(env.action_space, "low", None)
    high = getattr(env.action_space, "high", None)
    image = np.dtype(env.observation_space.dtype) == np.uint8
    recording: EpisodeVideo | None = None
    try:
        obs, _ = env.reset(seed=seed)
        if video is not None:
            recording = EpisodeVideo(video, float(env.metadata.get("render_fps") or 30))
            recording.add(frame(env))
        history = (ObsHistory(1, agent.context, math.prod(env.observation_space.shape or ()))
                   if agent.context else None)
        total, length, done = 0.0, 0, False
        while not done:
            raw = torch.as_tensor(np.asarray(obs)[None],
                                  dtype=torch.uint8 if image else torch.float32)
            action = _action(algorithm, agent, raw, history, length, deterministic, generator)
            taken = action[0].numpy()
            if low is not None:
                taken = np.clip(taken, low, high)
            obs, reward, terminated, truncated, _ = env.step(taken)
            if recording is not None:
                recording.add(frame(env))
            total += float(reward)
            length += 1
            done = bool(terminated or truncated)
        if recording is not None:
            recording.close()
            recording = None
        return total, length
    finally:
        if recording is not None:  # an episode that failed leaves no partial video
            recording.close(keep=False)
        env.close()


def _action(algorithm: Algorithm[Any], agent: Agent, raw: torch.Tensor,
            history: ObsHistory | None, step: int, deterministic: bool,
            generator: torch.Generator) -> torch.Tensor:
    """The action for one raw observation [1, *obs] at ``step`` of the episode."""
    with torch.no_grad():
        if history is None:
            seen = agent.observe(raw)
        else:  # the episode's window, as a collector keeps it
            if step == 0:
                history.reset(raw.reshape(1, -1))
            else:
                history.push(raw.reshape(1, -1), torch.zeros(1))
            seen = agent.observe_window(history.window())
        if deterministic:
            return algorithm.greedy(agent.net, seen)
        return algorithm.act(agent.net, seen, generator)[0]
