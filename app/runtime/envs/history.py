"""The window of recent observations a collecting rank keeps per env, for a policy with memory
(:class:`app.runtime.models.transformer.TransformerActorCritic`).

Each env's window holds its last ``context`` observations of the current episode, oldest first,
newest last, each with a validity flag as its last feature: 1.0 for a real step, 0.0 for the
padding before the episode started. A window never reaches back into an earlier episode.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["ObsHistory"]


class ObsHistory:
    """Windows [num_envs, context, obs_dim + 1] of a vector env's observations.

    Follows the runtime's SAME_STEP autoreset: after a step with ``done``, the returned
    observation is already the first of the next episode, so :meth:`push` starts that env's
    window over with it.
    """

    def __init__(self, num_envs: int, context: int, obs_dim: int) -> None:
        if num_envs < 1 or context < 1 or obs_dim < 1:
            raise ValueError(f"num_envs, context and obs_dim must be positive, got "
                             f"{num_envs}, {context}, {obs_dim}")
        self.num_envs, self.context, self.obs_dim = num_envs, context, obs_dim
        self._windows = torch.zeros(num_envs, context, obs_dim + 1)

    def _check(self, obs: Tensor, rows: int | None = None) -> Tensor:
        rows = self.num_envs if rows is None else rows
        if tuple(obs.shape) != (rows, self.obs_dim):
            raise ValueError(f"observations must be [{rows}, {self.obs_dim}], "
                             f"got {list(obs.shape)}")
        return obs.to(torch.float32)

    def _step(self, obs: Tensor) -> Tensor:
        """Observations [n, obs_dim] as window steps [n, 1, obs_dim + 1], flagged real."""
        return torch.cat([obs, obs.new_ones(len(obs), 1)], dim=1)[:, None]

    def reset(self, obs: Tensor) -> None:
        """Every env starts over: its window is ``obs`` [N, obs_dim] alone after padding."""
        obs = self._check(obs)
        self._windows.zero_()
        self._windows[:, -1, :-1] = obs
        self._windows[:, -1, -1] = 1.0

    def push(self, obs: Tensor, done: Tensor) -> None:
        """Append the observations ``obs`` [N, obs_dim] returned by a step. Where ``done`` [N]
        (bool or 0/1) is set, that env's episode just restarted and ``obs`` is its first: the
        env's window is cleared before."""
        obs = self._check(obs)
        if tuple(done.shape) != (self.num_envs,):
            raise ValueError(f"done must be [{self.num_envs}], got {list(done.shape)}")
        # Shift left by one step; the oldest falls out.
        self._windows[:, :-1] = self._windows[:, 1:].clone()
        self._windows[done.bool(), :-1] = 0.0
        self._windows[:, -1, :-1] = obs
        self._windows[:, -1, -1] = 1.0

    def window(self) -> Tensor:
        """The windows [N, context, obs_dim + 1], oldest first, validity flag last (a copy:
        later pushes do not change it)."""
        return self._windows.clone()

    def window_with(self, obs: Tensor, envs: Tensor | np.ndarray | Sequence[int]) -> Tensor:
        """The windows [len(envs), context, obs_dim + 1] of the envs ``envs`` as they would be
        after ``obs`` [len(envs), obs_dim] as the next step of the same episode; the history is
        left as it is. For a cut episode's last observation, whose value bootstraps it while
        the env has already restarted."""
        index = torch.as_tensor(envs, dtype=torch.int64).reshape(-1)
        obs = self._check(obs, len(index))
        return torch.cat([self._windows[index, 1:], self._step(obs)], dim=1)
