"""The data an algorithm and the runtime exchange: an environment's spaces, what a step records
and a collected segment. Apart from app/runtime/core/algorithm.py so that the replay, which stores
segments, and the algorithm contract, which declares the replay it learns from, build on them
without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# (episodic return, episode length) of one finished episode.
Episode = tuple[float, int]


@dataclass(frozen=True)
class Spaces:
    """One environment's observation and action space (gymnasium spaces)."""

    observation: Any
    action: Any


@dataclass(frozen=True)
class Record:
    """One per-step field an algorithm records: its shape per env and its dtype."""

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32


class Segment(dict[str, Tensor]):
    """One collector's ``T`` steps of ``N`` envs, time-major, as the trainer receives it.

    Keys: ``obs`` [T, N, *obs] (what the policy saw: normalised when ``loop.env.normalize_obs``),
    ``actions`` [T, N, *action] (as sampled, before any clipping to the action space),
    ``rewards`` [T, N] (scaled when ``loop.env.normalize_reward``), ``dones`` [T, N]
    (``dones[t]``: ``obs[t]`` starts a new episode), one entry per :attr:`Algorithm.records`
    name [T, N, *shape], and ``next_obs`` [N, *obs] / ``next_done`` [N], the state after the
    last step. With :attr:`Algorithm.final_observations`, also ``truncated`` [T, N] (1 where
    step t's episode was cut by a time limit) and ``final_obs`` [T, N, *obs] (that episode's
    true last observation, as the policy saw it; zeros elsewhere). ``version``: the weights
    version it was collected with; ``lag``: how many versions that is behind the weights being
    trained.
    """

    version: int = 0
    lag: int = 0
    moments: dict[str, Tensor] = {}
