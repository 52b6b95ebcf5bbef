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

from app.runtime.core.algorithm import Algorithm
from app.runtime.envs.history import ObsHistory
from app.runtime.envs.vector import EnvConfig, make_env
from app.runtime.evaluation.video import EpisodeVideo, frame, make_rendering_env
from app.runtime.rollout.worker import Agent


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


BATCH = 16  # episodes stepped side by side: one policy forward for all of them


def run_episodes(
    algorithm: Algorithm[Any], agent: Agent, env: EnvConfig, episodes: int, seed: int,
    deterministic: bool = True, videos: Sequence[Path] = (),
) -> Episodes:
    """Run ``episodes`` episodes, episode ``i`` on a fresh env reset with ``seed + i``; episode
    ``i`` is also recorded as the mp4 ``videos[i]`` while there is one
    (app/runtime/evaluation/video.py).

    Up to :data:`BATCH` episodes run side by side, each on its own env, the policy acting for
    all of them in one forward. Stochastic actions are sampled with a generator seeded with
    ``seed``. A policy with a history (``agent.context``) sees each episode's window, as it
    does in training.
    """
    generator = torch.Generator().manual_seed(seed)
    returns: list[float] = []
    lengths: list[int] = []
    for first in range(0, episodes, BATCH):
        numbers = range(first, min(first + BATCH, episodes))
        batch = _Batch(algorithm, agent, env, [seed + i for i in numbers],
                       [videos[i] if i < len(videos) else None for i in numbers])
        try:
            batch.run(deterministic, generator)
        finally:
            batch.close()
        returns += batch.totals
        lengths += batch.lengths
    return Episodes(returns, lengths)


class _Batch:
    """Episodes stepped side by side, each on a fresh env, until every one has ended."""

    def __init__(self, algorithm: Algorithm[Any], agent: Agent, env_cfg: EnvConfig,
                 seeds: list[int], videos: list[Path | None]) -> None:
        self.algorithm, self.agent = algorithm, agent
        self.envs = [make_rendering_env(env_cfg) if video is not None
                     else make_env(env_cfg.id, env_cfg._target_, dict(env_cfg.kwargs))
                     for video in videos]
        space = self.envs[0].observation_space
        self.image = np.dtype(space.dtype) == np.uint8
        self.low = getattr(self.envs[0].action_space, "low", None)
        self.high = getattr(self.envs[0].action_space, "high", None)
        self.obs = [np.asarray(env.reset(seed=s)[0]) for env, s in zip(self.envs, seeds)]
        self.recordings: list[EpisodeVideo | None] = [None] * len(self.envs)
        for i, (env, video) in enumerate(zip(self.envs, videos)):
            if video is not None:
                recording = EpisodeVideo(video, float(env.metadata.get("render_fps") or 30))
                recording.add(frame(env))
                self.recordings[i] = recording
        self.history = (ObsHistory(len(self.envs), agent.context, math.prod(space.shape or ()))
                        if agent.context else None)
        self.totals = [0.0] * len(self.envs)
        self.lengths = [0] * len(self.envs)
        self.ended = [False] * len(self.envs)

    def run(self, deterministic: bool, generator: torch.Generator) -> None:
        while not all(self.ended):
            live = [i for i, ended in enumerate(self.ended) if not ended]
            actions = self._actions(live, deterministic, generator)
            for i, action in zip(live, actions):
                self._step(i, action.numpy())
        for i, recording in enumerate(self.recordings):
            if recording is not None:
                recording.close()
                self.recordings[i] = None

    def close(self) -> None:
        """Every env closed; a recording still open (an episode that failed) is dropped."""
        for recording in self.recordings:
            if recording is not None:
                recording.close(keep=False)
        for env in self.envs:
            env.close()

    def _actions(self, live: list[int], deterministic: bool,
                 generator: torch.Generator) -> torch.Tensor:
        """The policy's actions for the live episodes, in one forward."""
        raw = torch.as_tensor(np.stack(self.obs),
                              dtype=torch.uint8 if self.image else torch.float32)
        with torch.no_grad():
            if self.history is None:
                seen = self.agent.observe(raw[live])
            else:  # each episode's window, as a collector keeps it
                if max(self.lengths) == 0:
                    self.history.reset(raw.reshape(len(self.envs), -1))
                else:
                    self.history.push(raw.reshape(len(self.envs), -1),
                                      torch.zeros(len(self.envs)))
                seen = self.agent.observe_window(self.history.window()[live])
            if deterministic:
                return self.algorithm.greedy(self.agent.net, seen)
            return self.algorithm.act(self.agent.net, seen, generator)[0]

    def _step(self, i: int, action: np.ndarray) -> None:
        if self.low is not None:
            action = np.clip(action, self.low, self.high)
        obs, reward, terminated, truncated, _ = self.envs[i].step(action)
        self.obs[i] = np.asarray(obs)  # an ended episode's last stays: its row is not read
        recording = self.recordings[i]
        if recording is not None:
            recording.add(frame(self.envs[i]))
        self.totals[i] += float(reward)
        self.lengths[i] += 1
        self.ended[i] = bool(terminated or truncated)
