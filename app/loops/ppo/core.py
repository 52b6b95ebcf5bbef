"""Single-process building blocks of a CleanRL-style PPO for ``CartPole-v1``.

Nothing in here knows about ``torch.distributed``: rollout processes use
:class:`RolloutWorker`, ship :class:`Rollout` objects as one flat float32
tensor, and trainer processes call :func:`ppo_update` with a (possibly DDP
wrapped) :class:`ActorCritic`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.wrappers.vector import RecordEpisodeStatistics
from torch import nn
from torch.distributions import Categorical

from app.api import setting

ENV_ID = "CartPole-v1"
# The best return of one episode: +1 per step until the time limit. A higher target never fires.
MAX_RETURN = float(gym.spec(ENV_ID).max_episode_steps or float("inf"))

# (episodic return, episode length) of one finished episode.
Episode = tuple[float, int]


@dataclass
class PPOHyperParams:
    """PPO settings; defaults are tuned to solve CartPole-v1 quickly.

    Tuned by simulating two rollout workers + two DDP trainers in one process
    (2 x 16 x 64 = 2048 env steps per update): 30/30 seeds reached a mean
    return >= 475 over the last 20 episodes, after ~96k env steps on average
    (max 172k), ~6 s single-threaded CPU. 16 envs x 64 steps because the per-vector-step overhead
    dominates rollout cost, so more envs is cheaper per env step than longer rollouts.
    """

    num_envs: int = setting(16, "environments per collecting rank (one vector env)")
    num_steps: int = setting(64, "steps per environment per update (rollout length)")
    gamma: float = setting(0.99, "discount factor, in (0, 1]")
    gae_lambda: float = setting(0.95, "GAE lambda, in [0, 1]")
    lr: float = setting(2.5e-3, "Adam learning rate (> 0)")
    anneal_lr: bool = setting(True, "anneal the learning rate linearly to 0")
    # Over env steps (all collectors together), so a layout with fewer collectors (smaller
    # updates) anneals over the same amount of experience.
    anneal_env_steps: int = setting(204_800, "env steps over which the learning rate anneals")
    update_epochs: int = setting(4, "passes over each batch")
    # Per trainer, per epoch; fixed by config so all DDP ranks do the same number of optimizer
    # steps (2 was unstable: 3/10 seeds never solved).
    num_minibatches: int = setting(4, "minibatches per epoch and trainer")
    clip_coef: float = setting(0.2, "PPO ratio clip (> 0)")
    clip_vloss: bool = setting(True, "clip the value loss too")
    # CartPole needs no entropy bonus; 0.01 solved ~25% slower.
    ent_coef: float = setting(0.0, "entropy bonus coefficient (>= 0)")
    vf_coef: float = setting(0.5, "value loss coefficient (>= 0)")
    max_grad_norm: float = setting(0.5, "gradient clipping norm (> 0)")
    hidden_size: int = setting(64, "width of the actor and critic MLPs")
    # Otherwise the critic learns that step 500 "fails".
    bootstrap_truncated: bool = setting(True, "bootstrap V(final obs) at time-limit truncation")

    def range_errors(self, batch_per_trainer: int) -> list[str]:
        """Out-of-range settings as ``field: must be ..., got value`` (empty when all fit)."""
        checks = [
            ("num_envs", self.num_envs >= 1, "a positive integer"),
            ("num_steps", self.num_steps >= 1, "a positive integer"),
            ("gamma", 0 < self.gamma <= 1, "in (0, 1]"),
            ("gae_lambda", 0 <= self.gae_lambda <= 1, "in [0, 1]"),
            ("lr", self.lr > 0, "> 0"),
            ("anneal_env_steps", self.anneal_env_steps >= 1, "a positive integer"),
            ("update_epochs", self.update_epochs >= 1, "a positive integer"),
            ("num_minibatches", self.num_minibatches >= 1, "a positive integer"),
            ("clip_coef", self.clip_coef > 0, "> 0"),
            ("ent_coef", self.ent_coef >= 0, ">= 0"),
            ("vf_coef", self.vf_coef >= 0, ">= 0"),
            ("max_grad_norm", self.max_grad_norm > 0, "> 0"),
            ("hidden_size", self.hidden_size >= 1, "a positive integer"),
        ]
        errors = [f"{name}: must be {want}, got {getattr(self, name)}" for name, ok, want in checks if not ok]
        if not errors and self.num_minibatches > batch_per_trainer:
            errors.append(
                f"num_minibatches: must be at most the {batch_per_trainer} samples each trainer "
                f"gets per update, got {self.num_minibatches}"
            )
        return errors


def make_envs(num_envs: int, seed: int) -> gym.vector.VectorEnv:
    """Create seeded CartPole vector envs that record episode statistics.

    ``SAME_STEP`` autoreset keeps CleanRL semantics: the observation returned
    with ``done=True`` is already the first one of the next episode, so every
    step in a rollout is a real transition.
    """
    envs: gym.vector.VectorEnv = gym.vector.SyncVectorEnv(
        [lambda: gym.make(ENV_ID) for _ in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    envs = RecordEpisodeStatistics(envs)
    envs.reset(seed=seed)  # sub-env i is seeded with seed + i
    return envs


def _layer_init(layer: nn.Linear, std: float = float(np.sqrt(2)), bias: float = 0.0) -> nn.Linear:
    """Orthogonal weights / constant bias, as in CleanRL."""
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


class ActorCritic(nn.Module):
    """Separate tanh MLPs for the policy logits and the state value."""

    def __init__(self, obs_dim: int, num_actions: int, hidden_size: int = 64) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            _layer_init(nn.Linear(obs_dim, hidden_size)),
            nn.Tanh(),
            _layer_init(nn.Linear(hidden_size, hidden_size)),
            nn.Tanh(),
            _layer_init(nn.Linear(hidden_size, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            _layer_init(nn.Linear(obs_dim, hidden_size)),
            nn.Tanh(),
            _layer_init(nn.Linear(hidden_size, hidden_size)),
            nn.Tanh(),
            # Small std -> near-uniform initial policy.
            _layer_init(nn.Linear(hidden_size, num_actions), std=0.01),
        )

    def get_value(self, obs: torch.Tensor) -> torch.Tensor:
        """State values, shape [B]."""
        return self.critic(obs).squeeze(-1)

    def get_action_and_value(
        self,
        obs: torch.Tensor,
        action: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (action, logprob, entropy, value); samples an action if none is given."""
        # Skipping argument validation noticeably speeds up the per-step rollout path.
        dist = Categorical(logits=self.actor(obs), validate_args=False)
        if action is None:
            # Categorical.sample() takes no generator; multinomial does, which
            # makes sampling reproducible independently of the global RNG.
            action = torch.multinomial(dist.probs, 1, generator=generator).squeeze(-1)
        return action, dist.log_prob(action), dist.entropy(), self.get_value(obs)

    def forward(
        self, obs: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprob, entropy, value) of given actions; the training path, so DDP hooks fire."""
        _, logprob, entropy, value = self.get_action_and_value(obs, action)
        return logprob, entropy, value


@dataclass
class Rollout:
    """One worker's trajectory segment; time-major, T steps x N envs.

    ``dones[t]`` flags that ``obs[t]`` starts a new episode (CleanRL layout);
    ``next_obs``/``next_done`` are the state after the last step, for bootstrapping.
    """

    obs: torch.Tensor  # [T, N, obs_dim] float32
    actions: torch.Tensor  # [T, N] int64
    logprobs: torch.Tensor  # [T, N] float32
    rewards: torch.Tensor  # [T, N] float32
    dones: torch.Tensor  # [T, N] float32
    values: torch.Tensor  # [T, N] float32
    next_obs: torch.Tensor  # [N, obs_dim] float32
    next_done: torch.Tensor  # [N] float32

    @staticmethod
    def flat_size(num_steps: int, num_envs: int, obs_dim: int) -> int:
        """Number of float32 elements in :meth:`to_flat_tensor`'s output."""
        per_step = obs_dim + 5  # obs + actions, logprobs, rewards, dones, values
        return num_steps * num_envs * per_step + num_envs * (obs_dim + 1)

    def to_flat_tensor(self) -> torch.Tensor:
        """Pack all fields into one contiguous float32 tensor (field order as declared).

        Actions are small non-negative ints, so the float32 round trip is exact.
        """
        return torch.cat([getattr(self, f.name).reshape(-1).float() for f in fields(self)])

    @classmethod
    def from_flat_tensor(
        cls, t: torch.Tensor, num_steps: int, num_envs: int, obs_dim: int
    ) -> Rollout:
        """Inverse of :meth:`to_flat_tensor`; returned fields are views into ``t``."""
        if t.numel() != cls.flat_size(num_steps, num_envs, obs_dim):
            raise ValueError(
                f"flat rollout has {t.numel()} elements, expected "
                f"{cls.flat_size(num_steps, num_envs, obs_dim)}"
            )
        T, N, D = num_steps, num_envs, obs_dim
        shapes: list[tuple[int, ...]] = [
            (T, N, D),
            (T, N),
            (T, N),
            (T, N),
            (T, N),
            (T, N),
            (N, D),
            (N,),
        ]
        parts: list[torch.Tensor] = []
        offset = 0
        for shape in shapes:
            n = int(np.prod(shape))
            parts.append(t[offset : offset + n].view(shape))
            offset += n
        obs, actions, logprobs, rewards, dones, values, next_obs, next_done = parts
        return cls(obs, actions.long(), logprobs, rewards, dones, values, next_obs, next_done)


class RolloutWorker:
    """Owns seeded envs and the running env state between successive rollouts."""

    def __init__(
        self, num_envs: int, seed: int, gamma: float = 0.99, bootstrap_truncated: bool = True
    ) -> None:
        self.envs = make_envs(num_envs, seed)
        self.num_envs = num_envs
        self.gamma = gamma
        self.bootstrap_truncated = bootstrap_truncated
        obs_space = self.envs.single_observation_space
        assert obs_space.shape is not None
        self.obs_dim = int(np.prod(obs_space.shape))
        # Seeded separately from the envs so action sampling is reproducible.
        self.generator = torch.Generator().manual_seed(seed)
        # make_envs already reset with the seed; reset again with the same
        # seed to get the initial observations (same result, deterministic).
        obs, _ = self.envs.reset(seed=seed)
        self.next_obs = torch.as_tensor(obs, dtype=torch.float32)
        self.next_done = torch.zeros(num_envs)
        self.env_steps = 0

    @classmethod
    def from_hparams(cls, hp: PPOHyperParams, seed: int) -> RolloutWorker:
        """Worker configured from ``hp``."""
        return cls(hp.num_envs, seed, hp.gamma, hp.bootstrap_truncated)

    @torch.no_grad()
    def collect(self, policy: ActorCritic, num_steps: int) -> tuple[Rollout, list[Episode]]:
        """Run ``num_steps`` vector steps with ``policy``; return the rollout and finished episodes."""
        T, N, D = num_steps, self.num_envs, self.obs_dim
        obs = torch.zeros(T, N, D)
        actions = torch.zeros(T, N, dtype=torch.long)
        logprobs, rewards, dones, values = (torch.zeros(T, N) for _ in range(4))
        episodes: list[Episode] = []

        for t in range(T):
            obs[t] = self.next_obs
            dones[t] = self.next_done
            action, logprob, _, value = policy.get_action_and_value(
                self.next_obs, generator=self.generator
            )
            actions[t], logprobs[t], values[t] = action, logprob, value

            next_obs, reward, term, trunc, info = self.envs.step(action.numpy())
            reward_t = torch.as_tensor(reward, dtype=torch.float32)
            if self.bootstrap_truncated:
                reward_t += self._truncation_bootstrap(policy, term, trunc, info)
            rewards[t] = reward_t
            self.next_obs = torch.as_tensor(next_obs, dtype=torch.float32)
            self.next_done = torch.as_tensor(np.logical_or(term, trunc), dtype=torch.float32)

            if "_episode" in info:
                for i in np.flatnonzero(info["_episode"]):
                    episodes.append((float(info["episode"]["r"][i]), int(info["episode"]["l"][i])))

        self.env_steps += T * N
        rollout = Rollout(
            obs,
            actions,
            logprobs,
            rewards,
            dones,
            values,
            self.next_obs.clone(),
            self.next_done.clone(),
        )
        return rollout, episodes

    def _truncation_bootstrap(
        self, policy: ActorCritic, term: np.ndarray, trunc: np.ndarray, info: dict[str, Any]
    ) -> torch.Tensor:
        """gamma * V(final_obs) for envs cut by the time limit, else 0.

        With SAME_STEP autoreset the returned obs is already the reset one, so
        the true last observation only lives in ``info["final_obs"]``.
        """
        extra = torch.zeros(self.num_envs)
        idx = np.flatnonzero(trunc & ~term)
        if idx.size:
            final_obs = torch.as_tensor(np.stack(list(info["final_obs"][idx])), dtype=torch.float32)
            extra[idx] = self.gamma * policy.get_value(final_obs)
        return extra

    def close(self) -> None:
        """Close the underlying envs."""
        self.envs.close()


def compute_gae(
    rollout: Rollout, next_value: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimates and value targets, both [T, N]."""
    T = rollout.rewards.shape[0]
    advantages = torch.zeros_like(rollout.rewards)
    last_gae = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        if t == T - 1:
            next_nonterminal = 1.0 - rollout.next_done
            next_values = next_value
        else:
            # dones[t+1] says obs[t+1] is a fresh episode, i.e. step t ended one.
            next_nonterminal = 1.0 - rollout.dones[t + 1]
            next_values = rollout.values[t + 1]
        delta = rollout.rewards[t] + gamma * next_values * next_nonterminal - rollout.values[t]
        last_gae = delta + gamma * lam * next_nonterminal * last_gae
        advantages[t] = last_gae
    return advantages, advantages + rollout.values


def make_optimizer(policy: nn.Module, hp: PPOHyperParams) -> torch.optim.Adam:
    """Adam with CleanRL's eps=1e-5 (the PyTorch default 1e-8 is less stable for PPO)."""
    return torch.optim.Adam(policy.parameters(), lr=hp.lr, eps=1e-5)


def lr_at(hp: PPOHyperParams, env_steps: int) -> float:
    """Learning rate after ``env_steps``: linear decay over ``hp.anneal_env_steps`` if annealing."""
    if not hp.anneal_lr:
        return hp.lr
    frac = max(1.0 - env_steps / hp.anneal_env_steps, 0.0)
    return frac * hp.lr


def set_lr(optimizer: torch.optim.Optimizer, hp: PPOHyperParams, env_steps: int) -> float:
    """Apply :func:`lr_at` to every param group; returns the new learning rate."""
    lr = lr_at(hp, env_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def ppo_update(
    model: nn.Module,
    policy: ActorCritic,
    optimizer: torch.optim.Optimizer,
    rollouts: list[Rollout],
    hp: PPOHyperParams,
    generator: torch.Generator,
    decoupled: bool = False,
) -> dict[str, float]:
    """Run ``hp.update_epochs`` x ``hp.num_minibatches`` clipped-PPO steps on ``rollouts``.

    The behaviour policy is the one that collected the data: its log-probs were recorded then.
    With ``decoupled`` (data collected with older weights than ``policy``'s), the clip is
    centred on ``policy``'s weights as the update starts (the proximal policy), and each
    sample's objective is weighted by proximal / behaviour probability (decoupled PPO, Hilton
    et al. 2021): the update stays importance-corrected for the behaviour policy while its step
    is bounded around the current weights, not around stale ones.

    ``model`` is ``policy`` or a DDP wrapper around it: losses go through
    ``model(...)`` so gradient all-reduce hooks fire, while the no-grad value
    bootstrap uses ``policy`` directly. The step count depends only on ``hp``,
    so all DDP ranks stay in lockstep (hence no KL early stopping).
    """
    if not rollouts:
        raise ValueError("ppo_update needs at least one rollout")
    obs_l, act_l, logp_l, adv_l, ret_l, val_l = [], [], [], [], [], []
    with torch.no_grad():
        for r in rollouts:
            adv, ret = compute_gae(r, policy.get_value(r.next_obs), hp.gamma, hp.gae_lambda)
            obs_l.append(r.obs.reshape(-1, r.obs.shape[-1]))
            act_l.append(r.actions.reshape(-1))
            logp_l.append(r.logprobs.reshape(-1))
            val_l.append(r.values.reshape(-1))
            adv_l.append(adv.reshape(-1))
            ret_l.append(ret.reshape(-1))
    b_obs, b_actions, b_logprobs = torch.cat(obs_l), torch.cat(act_l), torch.cat(logp_l)
    b_advantages, b_returns, b_values = torch.cat(adv_l), torch.cat(ret_l), torch.cat(val_l)
    b_anchor, b_weight = b_logprobs, None
    if decoupled:
        with torch.no_grad():
            _, b_anchor, _, _ = policy.get_action_and_value(b_obs, b_actions)
        b_weight = (b_anchor - b_logprobs).exp()

    batch_size = b_obs.shape[0]
    minibatch_size = batch_size // hp.num_minibatches
    stats = {"pg_loss": 0.0, "v_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0, "clipfrac": 0.0}
    for _ in range(hp.update_epochs):
        perm = torch.randperm(batch_size, generator=generator)
        for k in range(hp.num_minibatches):
            mb = perm[k * minibatch_size : (k + 1) * minibatch_size]
            newlogprob, entropy, newvalue = model(b_obs[mb], b_actions[mb])
            logratio = newlogprob - b_anchor[mb]
            ratio = logratio.exp()

            mb_adv = b_advantages[mb]
            mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            pg_losses = torch.max(
                -mb_adv * ratio, -mb_adv * ratio.clamp(1 - hp.clip_coef, 1 + hp.clip_coef)
            )
            if b_weight is not None:
                pg_losses = pg_losses * b_weight[mb]
            pg_loss = pg_losses.mean()

            v_unclipped = (newvalue - b_returns[mb]) ** 2
            if hp.clip_vloss:
                v_clipped = b_values[mb] + (newvalue - b_values[mb]).clamp(
                    -hp.clip_coef, hp.clip_coef
                )
                v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - b_returns[mb]) ** 2).mean()
            else:
                v_loss = 0.5 * v_unclipped.mean()

            entropy_loss = entropy.mean()
            loss = pg_loss - hp.ent_coef * entropy_loss + hp.vf_coef * v_loss

            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), hp.max_grad_norm)
            optimizer.step()

            with torch.no_grad():
                # http://joschu.net/blog/kl-approx.html (k3 estimator)
                stats["approx_kl"] += ((ratio - 1) - logratio).mean().item()
                stats["clipfrac"] += ((ratio - 1.0).abs() > hp.clip_coef).float().mean().item()
            stats["pg_loss"] += pg_loss.item()
            stats["v_loss"] += v_loss.item()
            stats["entropy"] += entropy_loss.item()

    n = hp.update_epochs * hp.num_minibatches
    return {k: v / n for k, v in stats.items()}
