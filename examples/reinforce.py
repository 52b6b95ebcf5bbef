"""REINFORCE with a learned baseline: a complete algorithm on the runtime, in one file.

Run it from the repository root, on any layout, with nothing else to write::

    python -m app loop=custom loop._target_=examples.reinforce.ReinforceLoop
    python -m app loop=custom loop._target_=examples.reinforce.ReinforceLoop layout=single \\
        +loop.hparams.lr=1e-3 +loop.env.id=Acrobot-v1

(``+``: a custom loop's config file names only its ``_target_``; its fields are checked all
the same, before any rank starts.)

An algorithm supplies four things (``app/runtime/core/algorithm.py``): its settings, the acting
module, what a step records, and the update. The runtime does the rest: environments,
collecting, moving segments to the trainers, weight sync, checkpoints, the stop rule, records.

The policy gradient weights each action's log-probability by the discounted return that
followed it, minus a learned baseline V(s) (which cuts the variance, not the bias). A segment
cuts episodes at its end, so the return there is bootstrapped with V of the next observation.
Its defaults learn CartPole-v1 (mean return >= 475) in about 60k-160k env steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from app.api import LoopMetrics, setting
from app.runtime import Algorithm, AlgorithmSettings, Record, RLLoop, Segment, Spaces, UpdateInfo
from app.runtime.models.actor_critic import ActorCritic, space_problem


@dataclass
class ReinforceSettings(AlgorithmSettings):
    """The rollout's shape and gamma (inherited), then REINFORCE's own settings."""

    lr: float = setting(1e-3, "Adam learning rate (> 0)")
    # Several smaller steps per batch learn faster than one large one.
    num_minibatches: int = setting(8, "gradient steps per update, each on a random part of the batch")
    vf_coef: float = setting(0.5, "baseline (value) loss coefficient (>= 0)")
    ent_coef: float = setting(0.01, "entropy bonus coefficient (>= 0)")
    max_grad_norm: float = setting(5.0, "gradient clipping norm (> 0)")
    hidden_size: int = setting(64, "width of the policy and baseline MLPs")

    def range_errors(self, batch_per_trainer: int) -> list[str]:
        """The base's checks, then these settings' (``field: must be ..., got value``)."""
        checks = [
            ("lr", self.lr > 0, "> 0"),
            ("num_minibatches", 1 <= self.num_minibatches <= batch_per_trainer,
             f"in [1, {batch_per_trainer}] (the samples each trainer gets)"),
            ("vf_coef", self.vf_coef >= 0, ">= 0"),
            ("ent_coef", self.ent_coef >= 0, ">= 0"),
            ("max_grad_norm", self.max_grad_norm > 0, "> 0"),
            ("hidden_size", self.hidden_size >= 1, "a positive integer"),
        ]
        return super().range_errors(batch_per_trainer) + [
            f"{name}: must be {want}, got {getattr(self, name)}" for name, ok, want in checks if not ok
        ]


def discounted_returns(segment: Segment, bootstrap: Tensor, gamma: float) -> Tensor:
    """Return-to-go [T, N] of each step, bootstrapped with ``bootstrap`` [N] at the segment's end."""
    rewards, dones = segment["rewards"], segment["dones"].float()
    returns = torch.zeros_like(rewards)
    future = bootstrap
    for t in reversed(range(rewards.shape[0])):
        # dones[t + 1] flags that obs[t + 1] starts a new episode: step t ended one.
        ended = segment["next_done"].float() if t == rewards.shape[0] - 1 else dones[t + 1]
        future = rewards[t] + gamma * (1.0 - ended) * future
        returns[t] = future
    return returns


class Reinforce(Algorithm[ReinforceSettings]):
    """REINFORCE with a learned state-value baseline (Williams 1992; Sutton & Barto 13.4)."""

    records: ClassVar[dict[str, Record]] = {}  # observation, action, reward and done suffice
    losses: ClassVar[tuple[str, ...]] = ("pg_loss", "v_loss", "entropy")

    @classmethod
    def space_problem(cls, spaces: Spaces) -> str | None:
        """The model helper's limits: Discrete or Box actions, vector or image observations."""
        return space_problem(spaces)

    def build(self) -> nn.Module:
        return ActorCritic.from_spaces(self.spaces, self.settings.hidden_size)

    def act(self, module: nn.Module, obs: Tensor, generator: torch.Generator
            ) -> tuple[Tensor, dict[str, Tensor]]:
        action, _, _ = cast(ActorCritic, module).act(obs, generator)
        return action, {}

    def value(self, module: nn.Module, obs: Tensor) -> Tensor | None:
        # Episodes cut by a time limit did not fail: the runtime adds gamma * V(final obs).
        return cast(ActorCritic, module).value(obs)

    def update(self, model: nn.Module, module: nn.Module, segments: list[Segment],
               info: UpdateInfo) -> dict[str, float]:
        s = self.settings
        with torch.no_grad():  # the returns are targets: no gradient flows through them
            returns = torch.cat([
                discounted_returns(seg, cast(ActorCritic, module).value(seg["next_obs"]), s.gamma)
                .flatten(0, 1) for seg in segments
            ])
        obs = torch.cat([seg["obs"].flatten(0, 1) for seg in segments])
        actions = torch.cat([seg["actions"].flatten(0, 1) for seg in segments])

        # Every trainer takes num_minibatches steps: DDP needs all ranks to step alike.
        batch = returns.shape[0]
        perm = torch.randperm(batch, generator=info.generator)
        size = batch // s.num_minibatches
        totals = dict.fromkeys(self.losses, 0.0)
        for k in range(s.num_minibatches):
            mb = perm[k * size : (k + 1) * size]
            logprob, entropy, value = model(obs[mb], actions[mb])  # through DDP: grads averaged
            # The baseline centres the returns; scaling to unit std keeps the step size steady
            # as returns grow (without it, some CartPole seeds collapsed onto one action).
            advantage = returns[mb] - value.detach()
            advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
            pg_loss = -(advantage * logprob).mean()
            v_loss = 0.5 * ((returns[mb] - value) ** 2).mean()
            loss = pg_loss + s.vf_coef * v_loss - s.ent_coef * entropy.mean()

            info.optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), s.max_grad_norm)
            info.optimizer.step()
            for name, x in (("pg_loss", pg_loss), ("v_loss", v_loss), ("entropy", entropy.mean())):
                totals[name] += x.item() / s.num_minibatches
        return totals


@dataclass
class ReinforceLoop(RLLoop):
    """The runtime's settings (``loop.*``) plus REINFORCE's (``loop.hparams.*``)."""

    hparams: ReinforceSettings = setting(doc="REINFORCE settings", factory=ReinforceSettings)
    algorithm: ClassVar[type[Algorithm[Any]]] = Reinforce
    # The runtime's figures plus the last update's baseline loss: sweep.rank_by=v_loss works.
    metrics: ClassVar[LoopMetrics] = LoopMetrics({**RLLoop.metrics.directions, "v_loss": "min"},
                                                 RLLoop.metrics.headline)
