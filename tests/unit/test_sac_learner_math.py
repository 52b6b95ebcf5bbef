"""SAC's one-trainer learner step, which skips the gradients its step does not use and steps a
fused Adam, against CleanRL ``sac_continuous_action.py``'s update written out plainly here
(separate per-parameter Adams, every gradient computed): the same noise gives the same
networks, targets and entropy coefficient, to rounding."""

from __future__ import annotations

import copy
import math
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from app.loops.sac import SAC, SACSettings
from app.runtime.core.algorithm import Spaces, UpdateInfo
from app.runtime.replay.buffer import Batch

pytestmark = pytest.mark.unit

OBS, ACT = 5, 2


def _spaces() -> Spaces:
    return Spaces(observation=gym.spaces.Box(-1, 1, (OBS,), np.float32),
                  action=gym.spaces.Box(-2.0, 1.0, (ACT,), np.float32))


def _batch(seed: int, n: int = 64) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(obs=torch.randn(n, OBS, generator=g), actions=torch.rand(n, ACT, generator=g),
                 rewards=torch.randn(n, generator=g), next_obs=torch.randn(n, OBS, generator=g),
                 discounts=0.99 * (torch.rand(n, generator=g) > 0.1).float(),
                 weights=torch.ones(n), indices=torch.arange(n), extras={})


def _get_action(actor: Any, obs: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """CleanRL's ``Actor.get_action`` (its ``rsample`` noise drawn from ``gen``)."""
    mean, log_std = actor.gaussian(obs)
    std = log_std.exp()
    x_t = mean + std * torch.randn(mean.shape, generator=gen)
    y_t = torch.tanh(x_t)
    log_prob = torch.distributions.Normal(mean, std).log_prob(x_t)
    log_prob = log_prob - torch.log(actor.scale * (1 - y_t.pow(2)) + 1e-6)
    return y_t * actor.scale + actor.bias, log_prob.sum(1)


class CleanRLUpdate:
    """CleanRL's update loop body on ``net``'s networks, written as CleanRL writes it."""

    def __init__(self, net: Any, s: SACSettings) -> None:
        self.net, self.s = net, s
        self.q_opt = torch.optim.Adam([*net.q1.parameters(), *net.q2.parameters()], lr=s.q_lr)
        self.actor_opt = torch.optim.Adam(list(net.actor.parameters()), lr=s.policy_lr)
        self.log_alpha = torch.zeros(1, requires_grad=True)
        self.a_opt = torch.optim.Adam([self.log_alpha], lr=s.q_lr)
        self.target_entropy = -float(ACT)

    def q(self, q: nn.Module, obs: Tensor, act: Tensor) -> Tensor:
        return q(torch.cat([obs, act], 1)).view(-1)

    def step(self, step: int, d: Batch, gen: torch.Generator) -> None:
        net, s = self.net, self.s
        alpha = self.log_alpha.exp().item()
        with torch.no_grad():
            next_a, next_log_pi = _get_action(net.actor, d.next_obs, gen)
            min_next = torch.min(self.q(net.q1_target, d.next_obs, next_a),
                                 self.q(net.q2_target, d.next_obs, next_a)) - alpha * next_log_pi
            next_q = d.rewards + d.discounts * min_next
        q_loss = (F.mse_loss(self.q(net.q1, d.obs, d.actions), next_q)
                  + F.mse_loss(self.q(net.q2, d.obs, d.actions), next_q))
        self.q_opt.zero_grad()
        q_loss.backward()
        self.q_opt.step()
        if step % s.policy_frequency == 0:
            for _ in range(s.policy_frequency):
                pi, log_pi = _get_action(net.actor, d.obs, gen)
                min_q = torch.min(self.q(net.q1, d.obs, pi), self.q(net.q2, d.obs, pi))
                actor_loss = (alpha * log_pi - min_q).mean()
                self.actor_opt.zero_grad()
                actor_loss.backward()
                self.actor_opt.step()
                with torch.no_grad():
                    _, log_pi = _get_action(net.actor, d.obs, gen)
                alpha_loss = (-self.log_alpha.exp() * (log_pi + self.target_entropy)).mean()
                self.a_opt.zero_grad()
                alpha_loss.backward()
                self.a_opt.step()
                alpha = self.log_alpha.exp().item()
        with torch.no_grad():
            for q, target in ((net.q1, net.q1_target), (net.q2, net.q2_target)):
                for p, t in zip(q.parameters(), target.parameters(), strict=True):
                    t.copy_(s.tau * p + (1 - s.tau) * t)


def test_one_trainer_step_is_cleanrl_update_to_rounding() -> None:
    torch.manual_seed(0)
    settings = SACSettings(hidden_sizes=[32, 32])
    sac = SAC(settings, _spaces())
    ours: Any = sac.build()
    theirs: Any = copy.deepcopy(ours)
    reference = CleanRLUpdate(theirs, settings)
    info = UpdateInfo(sac.optimizer(ours), torch.Generator().manual_seed(7), 0, 0, 0)
    their_gen = torch.Generator().manual_seed(7)
    start = [p.detach().clone() for p in ours.parameters()]
    for step in range(6):
        batch = _batch(step)
        sac.learn(ours, ours, batch, info)
        sac.learner_steps += 1
        reference.step(step, batch, their_gen)
    moved = [not torch.equal(a, p) for a, p in zip(start, ours.parameters(), strict=True)]
    assert all(moved)  # actor, both Q-networks and both targets all stepped
    for (name, mine), theirs_p in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs_p, rtol=1e-4, atol=1e-5, msg=name)
    assert sac.log_alpha.item() == pytest.approx(reference.log_alpha.item(), rel=1e-5)
    assert math.isclose(float(ours.log_alpha), sac.log_alpha.item())


def test_one_trainer_actor_step_computes_no_q_gradient() -> None:
    torch.manual_seed(0)
    sac = SAC(SACSettings(hidden_sizes=[16]), _spaces())
    net: Any = sac.build()
    info = UpdateInfo(sac.optimizer(net), torch.Generator().manual_seed(0), 0, 0, 0)
    sac.learn(net, net, _batch(0), info)  # learner step 0: a Q step, then actor steps
    assert all(p.grad is None for p in [*net.q1.parameters(), *net.q2.parameters()])
    assert all(p.grad is not None for p in net.actor.parameters())
    # The Q-networks are trainable again afterwards, and their targets never are.
    assert all(p.requires_grad for p in [*net.q1.parameters(), *net.q2.parameters()])
    assert not any(p.requires_grad for p in net.q1_target.parameters())
