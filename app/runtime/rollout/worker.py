"""Collecting: a rank's vector env stepped with the acting module, into one segment.

The worker acts with what the trainers last sent: the algorithm's module and the normalisers'
statistics (:class:`Agent`). It records what the policy saw and the batch moments of what it
observed, so the trainers (who own the statistics) can fold them in.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from app.runtime.core.algorithm import Algorithm, Segment, Spaces
from app.runtime.core.data import Episode
from app.runtime.core.segments import Field, SegmentFormat
from app.runtime.envs.history import ObsHistory
from app.runtime.envs.normalize import ReturnTracker, RunningNorm
from app.runtime.envs.vector import EnvConfig, EnvError, make_vector_env
from app.runtime.models.actor_critic import action_dtype, action_shape, obs_shape

# What a segment carries for the trainers' normalisers (not for the update).
MOMENTS = ("obs_moments", "return_moments")


class Agent(nn.Module):
    """What a trainer sends its rollouts: the acting module (``net``) and, when enabled, the
    observation and reward normalisers' statistics (buffers, so they travel and are verified
    with the weights, and are checkpointed). ``context`` > 0: the policy sees each env's last
    ``context`` observations (app/runtime/envs/history.py), not just the newest."""

    def __init__(self, net: nn.Module, spaces: Spaces, env: EnvConfig, context: int = 0) -> None:
        super().__init__()
        self.net = net
        self.context = context
        self.obs_norm = RunningNorm(obs_shape(spaces)) if env.normalize_obs else None
        self.reward_norm = RunningNorm(()) if env.normalize_reward else None
        self.clip_obs, self.clip_reward = env.clip_obs, env.clip_reward

    def observe(self, raw: Tensor) -> Tensor:
        """What the policy sees of ``raw`` observations."""
        if self.obs_norm is None:
            return raw
        return self.obs_norm.normalize(raw, self.clip_obs)

    def observe_window(self, window: Tensor) -> Tensor:
        """What the policy sees of a history window [N, context, *obs, 1] (raw observations and
        the validity flag last): the observations normalised, padding left at zero."""
        valid = window[..., -1:]
        return torch.cat([self.observe(window[..., :-1]) * valid, valid], dim=-1)

    def policy_obs_shape(self, spaces: Spaces) -> tuple[int, ...]:
        """One env's observation as the policy takes it."""
        shape = obs_shape(spaces)
        return (self.context, math.prod(shape) + 1) if self.context else shape

    def normalizers(self) -> dict[str, Tensor]:
        """The statistics a checkpoint keeps besides the policy (empty when none is enabled)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("net.")}


def build_segment_format(algorithm: Algorithm[Any], spaces: Spaces, agent: Agent, num_steps: int,
                   num_envs: int) -> SegmentFormat:
    """Where each field of one packed segment lives (app/runtime/core/segments.py)."""
    T, N = num_steps, num_envs
    obs, obs_dtype = agent.policy_obs_shape(spaces), _obs_dtype(spaces, agent)
    fields = {
        "version": Field((1,), torch.int64),
        "obs": Field((T, N, *obs), obs_dtype),
        "actions": Field((T, N, *action_shape(spaces)), action_dtype(spaces)),
        "rewards": Field((T, N), torch.float32),
        "dones": Field((T, N), torch.float32),
        **{name: Field((T, N, *r.shape), r.dtype) for name, r in algorithm.records.items()},
        "next_obs": Field((N, *obs), obs_dtype),
        "next_done": Field((N,), torch.float32),
    }
    if algorithm.final_observations:
        fields["truncated"] = Field((T, N), torch.float32)
        fields["final_obs"] = Field((T, N, *obs), obs_dtype)
    if agent.obs_norm is not None:
        fields["obs_moments"] = Field((RunningNorm.moments_size(obs),), torch.float64)
    if agent.reward_norm is not None:
        fields["return_moments"] = Field((RunningNorm.moments_size(()),), torch.float64)
    return SegmentFormat(fields)


def _obs_dtype(spaces: Spaces, agent: Agent) -> torch.dtype:
    # Images stay bytes on the wire; everything else is what the policy sees, as float32.
    if agent.obs_norm is None and not agent.context and np.dtype(spaces.observation.dtype) == np.uint8:
        return torch.uint8
    return torch.float32


class RolloutWorker:
    """Owns a rank's seeded vector env and the env state between successive segments."""

    def __init__(self, algorithm: Algorithm[Any], spaces: Spaces, env: EnvConfig, agent: Agent,
                 seed: int) -> None:
        settings = algorithm.settings
        self.algorithm, self.spaces = algorithm, spaces
        self.num_envs, self.num_steps, self.gamma = (settings.num_envs, settings.num_steps,
                                                     settings.gamma)
        self.envs = make_vector_env(env, settings.num_envs, seed)
        self.env_id = env.id if not env._target_ else f"{env.id} ({env._target_})"
        self.segment_format = build_segment_format(algorithm, spaces, agent, settings.num_steps,
                                                   settings.num_envs)
        self.buffer = self.segment_format.empty()  # the segment being collected, packed
        self.obs_dtype = self.segment_format.fields["obs"].dtype
        self.obs_shape = obs_shape(spaces)
        # A policy with a context sees each env's recent observations (raw: normalised as read).
        self.history = (ObsHistory(settings.num_envs, agent.context, math.prod(self.obs_shape))
                        if agent.context else None)
        # Seeded separately from the envs so action sampling is reproducible.
        self.generator = torch.Generator().manual_seed(seed)
        # make_vector_env already reset with the seed; reset again with the same seed to get
        # the initial observations (same result, deterministic).
        raw, _ = self.envs.reset(seed=seed)
        self.raw_obs = self._tensor(raw)
        if self.history is not None:
            self.history.reset(self._flat(self.raw_obs))
        self.next_done = torch.zeros(settings.num_envs)
        self.returns = (ReturnTracker(settings.num_envs, settings.gamma)
                        if agent.reward_norm is not None else None)
        box = hasattr(spaces.action, "low")  # Box actions are clipped to their bounds
        self.low: np.ndarray | None = spaces.action.low if box else None
        self.high: np.ndarray | None = spaces.action.high if box else None
        # Measured time split (seconds, this worker's lifetime): stepping the envs, and the
        # policy's forward and sampling (the run reports them in its result's time_split_s).
        self.env_s = 0.0
        self.act_s = 0.0

    def use_segment_format(self, segment_format: SegmentFormat) -> None:
        """Collect into ``segment_format`` (the segment's fields plus what travels with it)."""
        self.segment_format, self.buffer = segment_format, segment_format.empty()

    @torch.no_grad()
    def collect(self, agent: Agent, version: int) -> tuple[Tensor, list[Episode]]:
        """Step ``num_steps`` times with ``agent``; returns the packed segment (this worker's
        buffer, valid until the next call) and the episodes that finished."""
        seg = self.segment_format.unpack(self.buffer)
        seg["version"][0] = version
        net, episodes, seen = agent.net, [], []
        for t in range(self.num_steps):
            obs = self._seen_by_policy(agent)
            seen.append(self.raw_obs)
            seg["obs"][t] = obs
            seg["dones"][t] = self.next_done
            tick = time.perf_counter()
            action, records = self.algorithm.act(net, obs, self.generator)
            self.act_s += time.perf_counter() - tick
            seg["actions"][t] = action
            for name in self.algorithm.records:
                seg[name][t] = records[name]

            tick = time.perf_counter()
            raw, reward, term, trunc, info = self._step(action)
            self.env_s += time.perf_counter() - tick
            reward_t = torch.as_tensor(reward, dtype=torch.float32)
            if self.returns is not None and agent.reward_norm is not None:
                self.returns.step(reward_t, torch.as_tensor(term, dtype=torch.float32),
                                  torch.as_tensor(trunc, dtype=torch.float32))
                reward_t = agent.reward_norm.scale(reward_t, agent.clip_reward)
            if self.algorithm.final_observations:
                self._keep_final(seg, t, agent, term, trunc, info)
            elif "final_obs" in info:
                reward_t += self._truncation_bootstrap(agent, term, trunc, info)
            seg["rewards"][t] = reward_t
            self.raw_obs = self._tensor(raw)
            self.next_done = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32)
            if self.history is not None:
                self.history.push(self._flat(self.raw_obs), self.next_done)
            if "_episode" in info:
                for i in np.flatnonzero(info["_episode"]):
                    episodes.append((float(info["episode"]["r"][i]), int(info["episode"]["l"][i])))

        seg["next_obs"].copy_(self._seen_by_policy(agent))
        seg["next_done"].copy_(self.next_done)
        if "obs_moments" in seg:
            seg["obs_moments"].copy_(RunningNorm.batch_moments(torch.stack(seen), self.obs_shape))
        if "return_moments" in seg and self.returns is not None:
            seg["return_moments"].copy_(self.returns.take_moments())
        return self.buffer, episodes

    def _seen_by_policy(self, agent: Agent) -> Tensor:
        """The policy's input now: the newest observations, or each env's history window."""
        if self.history is None:
            return agent.observe(self.raw_obs)
        return agent.observe_window(self.history.window())

    def _flat(self, obs: Tensor) -> Tensor:
        return obs.reshape(self.num_envs, -1).float()

    def _step(self, action: Tensor) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        try:
            return self.envs.step(self._env_action(action))
        except Exception as err:  # the run ends; the line says which env failed, and how
            raise EnvError(f"env {self.env_id} raised {type(err).__name__}: {err}") from err

    def _tensor(self, raw: Any) -> Tensor:
        return torch.as_tensor(raw, dtype=self.obs_dtype if self.obs_dtype == torch.uint8
                               else torch.float32)

    def _env_action(self, action: Tensor) -> np.ndarray:
        """Actions as the env takes them: Box actions clipped to its bounds (the segment keeps
        the sampled ones, whose log-probabilities were recorded)."""
        taken = action.numpy()
        if self.low is not None:
            taken = np.clip(taken, self.low, self.high)
        return taken

    def _final_seen(self, agent: Agent, idx: np.ndarray, info: dict[str, Any]) -> Tensor:
        """The last observation of the episodes of envs ``idx``, as the policy sees it. With
        SAME_STEP autoreset the returned obs is already the reset one: the last one lives in
        ``info["final_obs"]``."""
        raw_final = self._tensor(np.stack(list(info["final_obs"][idx])))
        if self.history is None:
            return agent.observe(raw_final)
        # The cut episode's window, ending with its last observation.
        rows = raw_final.reshape(len(idx), -1).float()
        return agent.observe_window(self.history.window_with(rows, idx))

    def _truncation_bootstrap(self, agent: Agent, term: np.ndarray, trunc: np.ndarray,
                              info: dict[str, Any]) -> Tensor:
        """gamma * V(final obs) for envs cut by a time limit, else 0."""
        extra = torch.zeros(self.num_envs)
        idx = np.flatnonzero(trunc & ~term)
        if idx.size:
            value = self.algorithm.value(agent.net, self._final_seen(agent, idx, info))
            if value is not None:
                extra[idx] = self.gamma * value
        return extra

    def _keep_final(self, seg: dict[str, Tensor], t: int, agent: Agent, term: np.ndarray,
                    trunc: np.ndarray, info: dict[str, Any]) -> None:
        """Step t's ``truncated`` flags and the cut episodes' last observations, for an
        algorithm that bootstraps them itself (:attr:`Algorithm.final_observations`)."""
        # Without a final observation a cut cannot bootstrap: it stays an end, as a termination.
        cut = (np.asarray(trunc & ~term) if "final_obs" in info
               else np.zeros(self.num_envs, dtype=bool))
        seg["truncated"][t] = torch.as_tensor(cut, dtype=torch.float32)
        seg["final_obs"][t].zero_()
        idx = np.flatnonzero(cut)
        if idx.size:
            seg["final_obs"][t][torch.as_tensor(idx)] = self._final_seen(agent, idx, info).to(
                seg["final_obs"].dtype)

    def close(self) -> None:
        self.envs.close()


def as_segment(segment_format: SegmentFormat, packed: Tensor, lag: int = 0) -> Segment:
    """A packed segment as the :class:`Segment` an update receives (views, no copy)."""
    fields = segment_format.unpack(packed)
    version = int(fields.pop("version")[0])
    moments = {k: fields.pop(k) for k in MOMENTS if k in fields}
    segment = Segment(fields)
    segment.version, segment.lag = version, lag
    segment.moments = moments
    return segment
