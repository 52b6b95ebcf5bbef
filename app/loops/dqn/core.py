"""DQN (Mnih et al. 2015) as an off-policy algorithm, optionally double DQN (van Hasselt et al.
2016) and prioritized (Schaul et al. 2016), no ``torch.distributed``.

The module holds the online Q-network, its target network (parameters without gradients, so a
checkpoint keeps it and DDP leaves it alone) and the exploration epsilon (a buffer, so it
travels to the collectors with the weights; with ``exploration=apex`` each collector holds
its own fixed epsilon instead, Ape-X's). The learner regresses ``Q(s, a)`` on
``r + gamma^n max_a' Q_target(s', a')`` (double DQN: the target network's value of the online
network's ``argmax``), with the n-step sum and discount the replay made.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from gymnasium import spaces as gym_spaces
from torch import Tensor, nn

from app.api import setting
from app.runtime.core.algorithm import AlgorithmSettings, Spaces, UpdateInfo, adam
from app.runtime.core.compiling import compiled
from app.runtime.replay.buffer import Batch, ReplaySettings
from app.runtime.replay.offpolicy import OffPolicyAlgorithm, hard_update

log = logging.getLogger(__name__)


# How collectors explore (DQNSettings.exploration).
EXPLORATIONS = ("anneal", "apex")


@dataclass
class DQNSettings(AlgorithmSettings):
    """DQN settings. The network, optimizer, discount and starting epsilon are CleanRL dqn.py's;
    the learning rate, target period, epsilon schedule, double DQN, Huber loss and the replay's
    n-step returns are tuned so that ``loop=dqn layout=single`` solves CartPole-v1 in far fewer
    env steps than CleanRL's 500k (docs/off-policy.md)."""

    num_envs: int = setting(8, "environments per collecting rank (one vector env)")
    num_steps: int = setting(16, "steps per environment per update (rollout length)")
    lr: float = setting(2e-3, "Adam learning rate (> 0)")
    hidden_sizes: list[int] = setting(doc="widths of the Q-network's hidden layers",
                                      factory=lambda: [120, 84])
    target_every: int = setting(250, "learner steps between copies into the target network")
    start_epsilon: float = setting(1.0, "exploration epsilon at the start, in [0, 1]")
    end_epsilon: float = setting(0.01, "exploration epsilon after the decay, in [0, 1]")
    # Over env steps, all collectors together (as CleanRL's exploration_fraction of its budget).
    exploration_env_steps: int = setting(10_000, "env steps over which epsilon decays linearly")
    double: bool = setting(True, "double DQN: the online network picks the next action")
    max_grad_norm: float = setting(10.0, "gradient clipping norm (> 0)")
    # Huber's linear tails keep large early TD errors from swamping the step.
    huber: bool = setting(True, "Huber (smooth L1) TD loss; false: squared error (CleanRL's)")
    exploration: str = setting(
        "anneal", "anneal: every collector's epsilon decays linearly (CleanRL's) | apex: "
        "collector i of N holds apex_epsilon ** (1 + apex_alpha * i / (N - 1)) (Ape-X)")
    apex_epsilon: float = setting(0.4, "Ape-X's base epsilon, in [0, 1] (exploration=apex)")
    apex_alpha: float = setting(7.0, "Ape-X's exponent spread, >= 0 (exploration=apex)")

    def range_errors(self, batch_per_trainer: int) -> list[str]:
        """The base's checks, then DQN's own (``field: must be ..., got value``)."""
        checks = [
            ("lr", self.lr > 0, "> 0"),
            ("hidden_sizes", len(self.hidden_sizes) >= 1 and min(self.hidden_sizes) >= 1,
             "one or more positive widths"),
            ("target_every", self.target_every >= 1, "a positive integer"),
            ("start_epsilon", 0 <= self.start_epsilon <= 1, "in [0, 1]"),
            ("end_epsilon", 0 <= self.end_epsilon <= 1, "in [0, 1]"),
            ("exploration_env_steps", self.exploration_env_steps >= 1, "a positive integer"),
            ("max_grad_norm", self.max_grad_norm > 0, "> 0"),
            ("exploration", self.exploration in EXPLORATIONS, f"one of {', '.join(EXPLORATIONS)}"),
            ("apex_epsilon", 0 <= self.apex_epsilon <= 1, "in [0, 1]"),
            ("apex_alpha", self.apex_alpha >= 0, ">= 0"),
        ]
        return super().range_errors(batch_per_trainer) + [
            f"{name}: must be {want}, got {getattr(self, name)}" for name, ok, want in checks if not ok
        ]


def epsilon_at(settings: DQNSettings, env_steps: int) -> float:
    """Linear decay from ``start_epsilon`` to ``end_epsilon`` over ``exploration_env_steps``."""
    done = min(env_steps / settings.exploration_env_steps, 1.0)
    return settings.start_epsilon + done * (settings.end_epsilon - settings.start_epsilon)


def apex_epsilon(epsilon: float, alpha: float, index: int, count: int) -> float:
    """Collector ``index`` of ``count``'s fixed epsilon, Ape-X's (Horgan et al. 2018)
    ``epsilon ** (1 + alpha * index / (count - 1))``; a lone collector holds ``epsilon``."""
    spread = index / (count - 1) if count > 1 else 0.0
    return float(epsilon ** (1 + alpha * spread))


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class QNetwork(nn.Module):
    """The online Q-network (``forward``), its target and the collectors' epsilon."""

    epsilon: Tensor

    def __init__(self, obs_dim: int, actions: int, hidden: list[int]) -> None:
        super().__init__()
        self.q = _mlp([obs_dim, *hidden, actions])
        self.target = copy.deepcopy(self.q).requires_grad_(False)
        self.register_buffer("epsilon", torch.ones(()))

    def forward(self, obs: Tensor) -> Tensor:
        return self.q(obs.flatten(1).float())

    def target_values(self, obs: Tensor) -> Tensor:
        return self.target(obs.flatten(1).float())

    def greedy(self, obs: Tensor) -> Tensor:
        return self.forward(obs).argmax(-1)


def dqn_targets(rewards: Tensor, discounts: Tensor, next_target_q: Tensor,
                next_online_q: Tensor | None = None) -> Tensor:
    """``r + discount * max_a Q_target(s', a)`` ([B]); with ``next_online_q`` (double DQN)
    ``r + discount * Q_target(s', argmax_a Q_online(s', a))``. ``discounts`` is ``gamma^n``,
    0 where the episode ended."""
    if next_online_q is None:
        bootstrap = next_target_q.max(-1).values
    else:
        pick = next_online_q.argmax(-1, keepdim=True)
        bootstrap = next_target_q.gather(-1, pick).squeeze(-1)
    return rewards + discounts * bootstrap


class DQN(OffPolicyAlgorithm[DQNSettings]):
    """DQN on the runtime: epsilon-greedy collectors, a learner on the replay."""

    losses = ("td_loss", "q_mean", "epsilon")
    compiles = True

    def __init__(self, settings: DQNSettings, spaces: Spaces,
                 replay: ReplaySettings | None = None) -> None:
        super().__init__(settings, spaces, replay)
        # exploration=apex: this collector's fixed epsilon (collector 0 of 1 until told).
        self.collector_epsilon = apex_epsilon(settings.apex_epsilon, settings.apex_alpha, 0, 1)

    def set_collector(self, index: int, count: int) -> None:
        """Ape-X: collector ``index`` of ``count`` explores with its own epsilon."""
        settings = self.settings
        self.collector_epsilon = apex_epsilon(settings.apex_epsilon, settings.apex_alpha, index,
                                              count)
        if settings.exploration == "apex":
            log.info("collector %d of %d explores with epsilon %.6g", index, count,
                     self.collector_epsilon)

    def epsilon(self, module: nn.Module) -> float | Tensor:
        """The epsilon this collector acts with: the schedule's, which the weights carry
        (anneal), or its own (apex)."""
        if self.settings.exploration == "apex":
            return self.collector_epsilon
        return module.epsilon  # type: ignore[return-value]

    @classmethod
    def space_problem(cls, spaces: Any) -> str | None:
        obs, act = spaces.observation, spaces.action
        if isinstance(act, gym_spaces.Box):
            return f"action space {act} is continuous: DQN needs a Discrete one (loop=sac acts in it)"
        if not isinstance(act, gym_spaces.Discrete) or int(act.start) != 0:
            return f"action space {act} is not supported: DQN needs a Discrete one starting at 0"
        if not isinstance(obs, gym_spaces.Box) or len(obs.shape) != 1:
            return f"observation space {obs} is not supported: DQN's MLP takes a 1-d Box"
        return None

    def build(self) -> nn.Module:
        obs_dim = math.prod(self.spaces.observation.shape)
        return QNetwork(obs_dim, int(self.spaces.action.n), list(self.settings.hidden_sizes))

    def optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        # The target network has no gradients: only the online network is stepped.
        return adam([p for p in module.parameters() if p.requires_grad], lr=self.settings.lr)

    def act(self, module: nn.Module, obs: Tensor,
            generator: torch.Generator) -> tuple[Tensor, dict[str, Tensor]]:
        greedy = module.greedy(obs)  # type: ignore[operator]
        n = obs.shape[0]
        explore = torch.rand(n, generator=generator) < self.epsilon(module)
        random = torch.randint(int(self.spaces.action.n), (n,), generator=generator)
        return torch.where(explore, random, greedy), {}

    def learn(self, model: nn.Module, module: nn.Module, batch: Batch,
              info: UpdateInfo) -> tuple[dict[str, float], Tensor | None]:
        net: Any = module
        loss, q, errors = self.td_losses(model, net, batch)
        info.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), self.settings.max_grad_norm)
        info.optimizer.step()
        if (self.learner_steps + 1) % self.settings.target_every == 0:
            hard_update(net.target, net.q)
        # The collectors act with the epsilon the next weights carry (anneal); Ape-X's are
        # fixed per collector, and the column shows the largest (collector 0's).
        annealed = self.settings.exploration == "anneal"
        net.epsilon.fill_(epsilon_at(self.settings, info.env_steps) if annealed
                          else self.settings.apex_epsilon)
        figures = {"td_loss": float(loss.detach()), "q_mean": float(q.mean()),
                   "epsilon": float(net.epsilon)}
        return figures, errors.abs()

    @functools.cached_property
    def td_losses(self) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
        """:meth:`_td_losses` as ``loop.compile`` says."""
        return compiled(self._td_losses, self.compile_mode, "DQN's step")

    def _td_losses(self, model: nn.Module, net: Any, batch: Batch
                   ) -> tuple[Tensor, Tensor, Tensor]:
        """The TD loss to differentiate, Q(s, a) [B] and the TD errors [B] (no gradient)."""
        with torch.no_grad():
            online_next = model(batch.next_obs) if self.settings.double else None
            targets = dqn_targets(batch.rewards, batch.discounts,
                                  net.target_values(batch.next_obs), online_next)
        q = model(batch.obs).gather(-1, batch.actions.long().reshape(-1, 1)).squeeze(-1)
        errors = targets - q
        per_sample = (nn.functional.smooth_l1_loss(q, targets, reduction="none")
                      if self.settings.huber else errors.pow(2))
        loss = (batch.weights * per_sample).mean()
        return loss, q.detach(), errors.detach()
