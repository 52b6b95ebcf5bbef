"""SAC (Haarnoja et al. 2018, with automatic entropy tuning) as an off-policy algorithm, no
``torch.distributed``. The defaults are CleanRL ``sac_continuous_action.py``'s.

The module holds a tanh-squashed Gaussian actor scaled to the action Box, twin Q-networks and
their target copies (parameters without gradients, so a checkpoint keeps them), plus two
buffers that travel with the weights: ``log_alpha`` (a copy of the entropy coefficient's log, so
that a checkpointed or exported module carries it) and ``uniform`` (1 until the learner's first
step: collectors act uniformly at random until the run has collected ``min_size`` transitions,
CleanRL's ``learning_starts``). ``log_alpha`` and its Adam are the algorithm's own state,
checkpointed through :meth:`SAC.state_dict`; on several trainers its gradient is averaged over them,
so every trainer's alpha and Adam stay equal.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from gymnasium import spaces as gym_spaces
from torch import Tensor, nn

from app.api import setting
from app.runtime.core.algorithm import AlgorithmSettings, Spaces, UpdateInfo
from app.runtime.core.compiling import compiled
from app.runtime.replay.buffer import Batch, ReplaySettings
from app.runtime.replay.offpolicy import OffPolicyAlgorithm, soft_update

# CleanRL's bounds on the actor's log standard deviation.
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0
# Keeps log(1 - tanh^2) finite where tanh saturates (CleanRL's, and the SAC paper's code).
TANH_EPS = 1e-6
# Adam's update as one kernel per step on CPU: the same update as the per-parameter loop (to
# rounding), at a fraction of a learner step's dispatches (docs/off-policy.md, "Learner speed";
# tests/unit/test_sac_learner_math.py).
FUSED_ADAM = True


@dataclass
class SACSettings(AlgorithmSettings):
    """SAC settings: CleanRL sac_continuous_action.py's defaults (docs/off-policy.md)."""

    num_envs: int = setting(4, "environments per collecting rank (one vector env)")
    num_steps: int = setting(8, "steps per environment per update (rollout length)")
    q_lr: float = setting(1e-3, "Adam learning rate of the Q-networks and of log alpha (> 0)")
    policy_lr: float = setting(3e-4, "Adam learning rate of the actor (> 0)")
    hidden_sizes: list[int] = setting(doc="widths of the actor's and Q-networks' hidden layers",
                                      factory=lambda: [256, 256])
    tau: float = setting(0.005, "Polyak rate of the target Q-networks, in (0, 1]")
    policy_frequency: int = setting(
        2, "learner steps between actor and alpha updates (each time that many of them, "
        "CleanRL's delayed form)")
    autotune: bool = setting(True, "tune alpha towards the target entropy -|A|")
    alpha: float = setting(0.2, "the entropy coefficient without autotune (> 0); autotune "
                           "starts from 1 (log alpha 0, CleanRL's)")

    def range_errors(self, batch_per_trainer: int) -> list[str]:
        """The base's checks, then SAC's own (``field: must be ..., got value``)."""
        checks = [
            ("q_lr", self.q_lr > 0, "> 0"),
            ("policy_lr", self.policy_lr > 0, "> 0"),
            ("hidden_sizes", len(self.hidden_sizes) >= 1 and min(self.hidden_sizes) >= 1,
             "one or more positive widths"),
            ("tau", 0 < self.tau <= 1, "in (0, 1]"),
            ("policy_frequency", self.policy_frequency >= 1, "a positive integer"),
            ("alpha", self.alpha > 0, "> 0"),
        ]
        return super().range_errors(batch_per_trainer) + [
            f"{name}: must be {want}, got {getattr(self, name)}" for name, ok, want in checks if not ok
        ]


def _mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def squashed_log_prob(normal: torch.distributions.Normal, pre_tanh: Tensor,
                      scale: Tensor) -> Tensor:
    """log pi(a|s) [B] of ``a = bias + scale * tanh(u)``, ``u ~ normal``: the Gaussian's log
    density minus the change of variables, ``sum_i log(scale_i (1 - tanh(u_i)^2))`` (SAC paper,
    appendix C; ``TANH_EPS`` inside the log, as CleanRL)."""
    squash = torch.log(scale * (1 - torch.tanh(pre_tanh).pow(2)) + TANH_EPS)
    return (normal.log_prob(pre_tanh) - squash).sum(-1)


def soft_q_targets(rewards: Tensor, discounts: Tensor, next_q1: Tensor, next_q2: Tensor,
                   next_log_pi: Tensor, alpha: Tensor | float) -> Tensor:
    """``r + discount * (min(Q1', Q2')(s', a') - alpha log pi(a'|s'))`` [B], ``a' ~ pi(s')``;
    ``discounts`` is the replay's ``gamma^n``, 0 where the episode ended."""
    return rewards + discounts * (torch.minimum(next_q1, next_q2) - alpha * next_log_pi)


def actor_loss(log_pi: Tensor, q1: Tensor, q2: Tensor, alpha: Tensor | float) -> Tensor:
    """``E[alpha log pi(a|s) - min(Q1, Q2)(s, a)]``, ``a ~ pi(s)`` reparameterised."""
    return (alpha * log_pi - torch.minimum(q1, q2)).mean()


def alpha_loss(log_alpha: Tensor, log_pi: Tensor, target_entropy: float) -> Tensor:
    """CleanRL's ``E[-exp(log_alpha) (log pi + target_entropy)]`` (``log_pi`` detached): alpha
    grows while the policy's entropy is under the target and shrinks above it."""
    return (-log_alpha.exp() * (log_pi.detach() + target_entropy)).mean()


class Actor(nn.Module):
    """A tanh-squashed diagonal Gaussian, scaled from (-1, 1) to the action Box."""

    scale: Tensor
    bias: Tensor

    def __init__(self, obs_dim: int, act_dim: int, hidden: list[int], low: Tensor,
                 high: Tensor) -> None:
        super().__init__()
        self.trunk = _mlp([obs_dim, *hidden])
        self.mean = nn.Linear(hidden[-1], act_dim)
        self.log_std = nn.Linear(hidden[-1], act_dim)
        self.register_buffer("scale", (high - low) / 2)
        self.register_buffer("bias", (high + low) / 2)

    def gaussian(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.relu(self.trunk(obs))
        log_std = torch.tanh(self.log_std(h))
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)
        return self.mean(h), log_std

    def sample(self, obs: Tensor, generator: torch.Generator | None = None,
               noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """A reparameterised action [B, A] and its log pi [B], from ``noise`` [B, A] (standard
        normal draws; by default drawn here from ``generator``)."""
        mean, log_std = self.gaussian(obs)
        std = log_std.exp()
        # No argument checks: std = exp(.) > 0 and pre_tanh is real by construction, and the
        # checks cost a learner step several reductions each time.
        normal = torch.distributions.Normal(mean, std, validate_args=False)
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype)
        pre_tanh = mean + std * noise
        action = torch.tanh(pre_tanh) * self.scale + self.bias
        return action, squashed_log_prob(normal, pre_tanh, self.scale)

    def greedy(self, obs: Tensor) -> Tensor:
        return torch.tanh(self.gaussian(obs)[0]) * self.scale + self.bias


class SACModule(nn.Module):
    """The actor, twin Q-networks, their targets and the collectors' ``log_alpha`` and ``uniform``."""

    log_alpha: Tensor
    uniform: Tensor

    def __init__(self, obs_dim: int, act_dim: int, hidden: list[int], low: Tensor, high: Tensor,
                 alpha: float) -> None:
        super().__init__()
        self.actor = Actor(obs_dim, act_dim, hidden, low, high)
        self.q1 = _mlp([obs_dim + act_dim, *hidden, 1])
        self.q2 = _mlp([obs_dim + act_dim, *hidden, 1])
        self.q1_target = copy.deepcopy(self.q1).requires_grad_(False)
        self.q2_target = copy.deepcopy(self.q2).requires_grad_(False)
        self.register_buffer("log_alpha", torch.tensor(math.log(alpha)))
        self.register_buffer("uniform", torch.ones(()))

    def forward(self, obs: Tensor, actions: Tensor | None = None,
                generator: torch.Generator | None = None,
                noise: Tensor | None = None) -> tuple[Tensor, ...]:
        """The learner's two passes, through DDP when there are several trainers (so every
        trainable parameter takes part and gradients are averaged): with ``actions``, the
        Q step's ``(Q1, Q2, tie)``; without, the actor step's ``(log pi, Q1, Q2)`` of a sampled
        action. ``tie`` is 0 times the actor's parameters: a zero gradient the learner drops."""
        if actions is not None:
            tie = sum((p.sum() for p in self.actor.parameters()), torch.zeros(()))
            return (*self.q(obs, actions), 0.0 * tie)
        action, log_pi = self.sample(obs, generator, noise)
        return (log_pi, *self.q(obs, action))

    def q(self, obs: Tensor, actions: Tensor, target: bool = False) -> tuple[Tensor, Tensor]:
        x = torch.cat([obs.flatten(1).float(), actions.float()], -1)
        q1, q2 = (self.q1_target, self.q2_target) if target else (self.q1, self.q2)
        return q1(x).squeeze(-1), q2(x).squeeze(-1)

    def sample(self, obs: Tensor, generator: torch.Generator | None = None,
               noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.actor.sample(obs.flatten(1).float(), generator, noise)

    def greedy(self, obs: Tensor) -> Tensor:
        return self.actor.greedy(obs.flatten(1).float())



@contextmanager
def _frozen(*modules: nn.Module) -> Iterator[None]:
    """``modules``' parameters as constants for the graphs built inside: a backward computes no
    gradient for them (the gradients with respect to their inputs still flow)."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _drop_grads(*modules: nn.Module) -> None:
    """Clear gradients after backward (and DDP's averaging): Adam skips a parameter without one,
    moments included, as CleanRL's separate optimizers leave the other networks alone."""
    for m in modules:
        for p in m.parameters():
            p.grad = None


class SAC(OffPolicyAlgorithm[SACSettings]):
    """SAC on the runtime: sampling collectors, a learner on the replay."""

    losses = ("q_loss", "actor_loss", "alpha_loss", "alpha", "q_mean", "entropy")
    compiles = True

    def __init__(self, settings: SACSettings, spaces: Spaces,
                 replay: ReplaySettings | None = None) -> None:
        super().__init__(settings, spaces, replay)
        self.target_entropy = -float(math.prod(spaces.action.shape))
        self.log_alpha = torch.tensor(math.log(self.start_alpha(settings)), requires_grad=True)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=settings.q_lr,
                                                fused=FUSED_ADAM)
        self._figures = {"actor_loss": math.nan, "alpha_loss": math.nan, "entropy": math.nan}

    @staticmethod
    def start_alpha(settings: SACSettings) -> float:
        return 1.0 if settings.autotune else settings.alpha

    @classmethod
    def space_problem(cls, spaces: Any) -> str | None:
        obs, act = spaces.observation, spaces.action
        if not isinstance(act, gym_spaces.Box):
            return f"action space {act} is discrete: SAC needs a Box (loop=dqn acts in it)"
        if len(act.shape) != 1 or not (act.is_bounded("both")):
            return f"action space {act} is not supported: SAC needs a bounded 1-d Box"
        if not isinstance(obs, gym_spaces.Box) or len(obs.shape) != 1:
            return f"observation space {obs} is not supported: SAC's MLPs take a 1-d Box"
        return None

    def build(self) -> nn.Module:
        act = self.spaces.action
        low = torch.as_tensor(act.low, dtype=torch.float32)
        high = torch.as_tensor(act.high, dtype=torch.float32)
        return SACModule(math.prod(self.spaces.observation.shape), int(act.shape[0]),
                         list(self.settings.hidden_sizes), low, high,
                         self.start_alpha(self.settings))

    def optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        """One Adam, two groups: the actor at ``policy_lr``, the Q-networks at ``q_lr`` (the
        targets have no gradients and are not stepped)."""
        net: Any = module
        q_params = [*net.q1.parameters(), *net.q2.parameters()]
        return torch.optim.Adam([{"params": list(net.actor.parameters()),
                                  "lr": self.settings.policy_lr},
                                 {"params": q_params, "lr": self.settings.q_lr}],
                                fused=FUSED_ADAM)

    def act(self, module: nn.Module, obs: Tensor,
            generator: torch.Generator) -> tuple[Tensor, dict[str, Tensor]]:
        net: Any = module
        if bool(net.uniform):  # before learning starts: CleanRL's uniform random actions
            u = torch.rand((obs.shape[0], *net.actor.scale.shape), generator=generator)
            return net.actor.bias + net.actor.scale * (2 * u - 1), {}
        return net.sample(obs, generator)[0], {}

    def greedy(self, module: nn.Module, obs: Tensor) -> Tensor:
        return module.greedy(obs)  # type: ignore[operator]

    def learn(self, model: nn.Module, module: nn.Module, batch: Batch,
              info: UpdateInfo) -> tuple[dict[str, float], Tensor | None]:
        """One learner step: the Q-networks', then every ``policy_frequency``-th step that many
        actor (and alpha) steps, then the targets' Polyak step. Through DDP (``model`` is not
        ``module``: several trainers) every pass involves every parameter and the gradients
        the step does not use are dropped after the averaging; one trainer computes only the
        gradients its step uses."""
        net: Any = module
        alpha = self.log_alpha.detach().exp()
        next_noise = self._noise(batch.next_obs, info.generator)
        loss, q_loss, q1, q2, targets = self.q_losses(model, net, batch, next_noise, alpha)
        info.optimizer.zero_grad()
        loss.backward()
        if model is not module:
            _drop_grads(net.actor)  # the Q step moves only the Q-networks
        info.optimizer.step()
        if self.learner_steps % self.settings.policy_frequency == 0:
            for _ in range(self.settings.policy_frequency):
                self._policy_step(model, net, batch, info)
        soft_update(net.q1_target, net.q1, self.settings.tau)
        soft_update(net.q2_target, net.q2, self.settings.tau)
        net.uniform.fill_(0.0)  # learning started: the collectors sample the actor from now
        with torch.no_grad():
            errors = (q1 - targets).abs() + (q2 - targets).abs()
            figures = {"q_loss": float(q_loss), "alpha": float(self.log_alpha.exp()),
                       "q_mean": float(torch.minimum(q1, q2).mean()), **self._figures}
        return figures, errors / 2

    def _noise(self, obs: Tensor, generator: torch.Generator) -> Tensor:
        """The standard normal draws of one reparameterised sample of actions for ``obs``,
        drawn outside the (compiled) losses, in the order the update takes them."""
        return torch.randn((obs.shape[0], *self.spaces.action.shape), generator=generator)

    @functools.cached_property
    def q_losses(self) -> Callable[..., tuple[Tensor, ...]]:
        """:meth:`_q_losses` as ``loop.compile`` says."""
        return compiled(self._q_losses, self.compile_mode, "SAC's Q step")

    @functools.cached_property
    def actor_losses(self) -> Callable[..., tuple[Tensor, ...]]:
        """:meth:`_actor_losses` as ``loop.compile`` says."""
        return compiled(self._actor_losses, self.compile_mode, "SAC's actor step")

    @staticmethod
    def _q_losses(model: nn.Module, net: Any, batch: Batch, next_noise: Tensor, alpha: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The Q step's loss to differentiate (with DDP's zero ``tie`` to the actor), the loss,
        Q1 and Q2 at the batch's actions [B] and the soft targets [B] (no gradient). Through
        DDP (``model`` is not ``net``: several trainers) every pass involves every parameter;
        one trainer computes only the Q-networks' gradients."""
        alone = model is net
        if alone:
            q1, q2 = net.q(batch.obs, batch.actions)
            tie: Tensor | float = 0.0
        else:
            q1, q2, tie = model(batch.obs, batch.actions)
        with torch.no_grad():
            next_actions, next_log_pi = net.sample(batch.next_obs, noise=next_noise)
            next_q1, next_q2 = net.q(batch.next_obs, next_actions, target=True)
            targets = soft_q_targets(batch.rewards, batch.discounts, next_q1, next_q2,
                                     next_log_pi, alpha)
        q_loss = (batch.weights * ((q1 - targets).pow(2) + (q2 - targets).pow(2))).mean()
        return q_loss + tie, q_loss.detach(), q1.detach(), q2.detach(), targets

    @staticmethod
    def _actor_losses(model: nn.Module, obs: Tensor, noise: Tensor, alpha: Tensor
                      ) -> tuple[Tensor, Tensor]:
        """The actor step's loss of a sampled action and its log pi [B]."""
        log_pi, q1, q2 = model(obs, noise=noise)
        return actor_loss(log_pi, q1, q2, alpha), log_pi

    def _policy_step(self, model: nn.Module, net: Any, batch: Batch, info: UpdateInfo) -> None:
        """One actor step (only the actor's parameters move) and, with autotune, one alpha step."""
        alpha = self.log_alpha.detach().exp()
        info.optimizer.zero_grad()
        noise = self._noise(batch.obs, info.generator)
        alone = model is net
        if alone:  # one trainer: no gradient for the Q-networks' parameters at all
            with _frozen(net.q1, net.q2):
                loss, log_pi = self.actor_losses(model, batch.obs, noise, alpha)
                loss.backward()
        else:
            loss, log_pi = self.actor_losses(model, batch.obs, noise, alpha)
            loss.backward()
            _drop_grads(net.q1, net.q2)  # the actor step moves only the actor
        info.optimizer.step()
        figures = {"actor_loss": float(loss.detach()), "entropy": float(-log_pi.mean().detach()),
                   "alpha_loss": math.nan}
        if self.settings.autotune:
            with torch.no_grad():  # CleanRL's: the entropy of the actor just stepped
                log_pi = net.sample(batch.obs, info.generator)[1]
            a_loss = alpha_loss(self.log_alpha, log_pi, self.target_entropy)
            self.alpha_optimizer.zero_grad()
            a_loss.backward()
            # Every trainer's batch counts, and every trainer's alpha and Adam stay equal.
            assert self.log_alpha.grad is not None
            info.peers.average(self.log_alpha.grad)
            self.alpha_optimizer.step()
            net.log_alpha.copy_(self.log_alpha.detach())
            figures["alpha_loss"] = float(a_loss.detach())
        self._figures = figures

    def state_dict(self) -> dict[str, Any]:
        """The base's (replay counters, learner steps) plus log alpha and its Adam."""
        return {**super().state_dict(), "log_alpha": self.log_alpha.detach().clone(),
                "alpha_optimizer": self.alpha_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
