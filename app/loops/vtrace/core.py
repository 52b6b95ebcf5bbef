"""IMPALA's V-trace actor-critic (Espeholt et al. 2018, section 4 and appendix) as an algorithm.

A collector acts with the weights it holds (the *behaviour* policy mu) and records each step's
log-probability under mu. By the time a trainer learns from that segment, its own weights (the
*target* policy pi) may be a few versions ahead. V-trace corrects for the gap with truncated
importance weights ``rho_t = min(rho_bar, pi/mu)`` and traces ``c_t = lambda min(c_bar, pi/mu)``:

- value targets ``v_s = V(x_s) + sum_t gamma^(t-s) (prod_{i<t} c_i) rho_t delta_t``, with
  ``delta_t = r_t + gamma V(x_{t+1}) - V(x_t)`` (the recursion in :func:`vtrace_targets`);
- the policy gradient ``rho_s (r_s + gamma v_{s+1} - V(x_s)) grad log pi(a_s | x_s)``.

On-policy (pi = mu) with ``rho_bar, c_bar >= 1``, ``v_s`` is the lambda-return bootstrapped at
the segment's end (with ``lambda = 1`` the n-step return), so the update is a plain actor-critic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import Tensor, nn

from app.api import setting
from app.runtime.core.algorithm import (
    Algorithm,
    AlgorithmSettings,
    Record,
    Segment,
    Spaces,
    UpdateInfo,
)
from app.runtime.models.actor_critic import ActorCritic, space_problem


@dataclass
class VTraceSettings(AlgorithmSettings):
    """V-trace settings; defaults learn CartPole-v1.

    They are tuned for the default 2t2r layout with ``loop.max_staleness=1``: two collectors of
    16 envs x 64 steps each per update, trained on with weights one update old. Several
    minibatch steps per batch, because one large step with normalised advantages (IMPALA's
    shape) did not solve CartPole in tuning at learning rates from 1e-3 to 5e-3. The tuning
    runs' figures: benchmarks/results/2026-12-02.md.
    """

    lr: float = setting(1.5e-3, "Adam learning rate (> 0)")
    anneal_lr: bool = setting(True, "anneal the learning rate linearly to 0")
    # Over env steps (all collectors together), so a layout with fewer collectors (smaller
    # updates) anneals over the same amount of experience.
    anneal_env_steps: int = setting(409_600, "env steps over which the learning rate anneals")
    rho_bar: float = setting(1.0, "V-trace: truncation of the importance weights rho (> 0)")
    # c_bar <= rho_bar in the paper: c only sets how far back a correction travels.
    c_bar: float = setting(1.0, "V-trace: truncation of the trace coefficients c (> 0)")
    # The appendix's lambda (c_t = lambda min(c_bar, pi/mu)): shorter traces, less variance.
    # 1.0 also solved CartPole, on average 60% later.
    trace_lambda: float = setting(0.95, "V-trace: lambda, discounting the traces c, in [0, 1]")
    vf_coef: float = setting(0.5, "value loss coefficient (>= 0)")
    # The usual actor-critic bonus; 0.02 did no better.
    ent_coef: float = setting(0.01, "entropy bonus coefficient (>= 0)")
    # 0.5 (PPO's) learnt slower; 40 (IMPALA's) let 2 of 18 seeds collapse onto one action.
    max_grad_norm: float = setting(5.0, "gradient clipping norm (> 0)")
    hidden_size: int = setting(64, "width of the actor and critic MLPs")
    # Without PPO's clip, a second pass lets the policy run away from the data: it learnt
    # slower or collapsed.
    update_epochs: int = setting(1, "passes over each batch")
    # Whole env columns per minibatch: V-trace's recursion runs along each column's time axis.
    # More, smaller steps learnt faster than one large one. Per segment, so that a step is the
    # same size on every layout: a trainer that several collectors feed (1t3r: three segments
    # per update) takes as many steps per env step as one fed by one. Eight per trainer on 1t3r
    # (steps of 6 columns, a third as many per env step) solved 7 of 10 seeds, at a median of
    # 190k env steps; 8 per segment, 9 of 10 at 95k (benchmarks/results/2026-12-06-seeds.md).
    num_minibatches: int = setting(
        8, "minibatches per pass, per segment the trainer is handed (split over env columns)")
    # At this learning rate normalised advantages collapsed the policy onto one action (4/4
    # seeds); at lower rates they kept it drifting off the optimum.
    normalize_advantages: bool = setting(False, "normalise the policy-gradient advantages per minibatch")
    # Otherwise the critic learns that the time limit "fails".
    bootstrap_truncated: bool = setting(True, "bootstrap V(final obs) at time-limit truncation")

    def range_errors(self, batch_per_trainer: int) -> list[str]:
        """The base's checks, then V-trace's own (``field: must be ..., got value``)."""
        checks = [
            ("lr", self.lr > 0, "> 0"),
            ("anneal_env_steps", self.anneal_env_steps >= 1, "a positive integer"),
            ("rho_bar", self.rho_bar > 0, "> 0"),
            ("c_bar", self.c_bar > 0, "> 0"),
            ("trace_lambda", 0 <= self.trace_lambda <= 1, "in [0, 1]"),
            ("vf_coef", self.vf_coef >= 0, ">= 0"),
            ("ent_coef", self.ent_coef >= 0, ">= 0"),
            ("max_grad_norm", self.max_grad_norm > 0, "> 0"),
            ("hidden_size", self.hidden_size >= 1, "a positive integer"),
            ("update_epochs", self.update_epochs >= 1, "a positive integer"),
            ("num_minibatches", self.num_minibatches >= 1, "a positive integer"),
        ]
        errors = super().range_errors(batch_per_trainer) + [
            f"{name}: must be {want}, got {getattr(self, name)}" for name, ok, want in checks if not ok
        ]
        if not errors and self.num_minibatches > self.num_envs:
            errors.append(
                f"num_minibatches: must be at most the {self.num_envs} env columns of a segment "
                f"(num_envs), got {self.num_minibatches}"
            )
        return errors


def lr_at(settings: VTraceSettings, env_steps: int) -> float:
    """The learning rate after ``env_steps``: linear decay to 0 over ``anneal_env_steps``."""
    if not settings.anneal_lr:
        return settings.lr
    return max(1.0 - env_steps / settings.anneal_env_steps, 0.0) * settings.lr


def discounts_from_dones(dones: Tensor, next_done: Tensor, gamma: float) -> Tensor:
    """``gamma`` per step [T, N], 0 where the step ended an episode.

    ``dones[t]`` flags that ``obs[t]`` starts a new episode, so step t ended one iff
    ``dones[t + 1]`` (``next_done`` for the last step).
    """
    ended = torch.cat([dones[1:], next_done[None]])
    if not ended.is_floating_point():  # bool or integer flags; float ones keep their precision
        ended = ended.float()
    return gamma * (1.0 - ended)


def vtrace_targets(
    behaviour_logprob: Tensor,
    target_logprob: Tensor,
    rewards: Tensor,
    values: Tensor,
    bootstrap_value: Tensor,
    discounts: Tensor,
    rho_bar: float,
    c_bar: float,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """V-trace value targets ``vs`` and policy-gradient advantages, both [T, N].

    Time-major inputs [T, N]; ``bootstrap_value`` [N] is V of the state after the last step;
    ``discounts[t]`` is gamma, or 0 where step t ended an episode; ``lam`` scales the traces
    (``c_t = lam min(c_bar, pi/mu)``). The backward recursion of the paper's appendix:
    ``vs_t - V_t = rho_t delta_t + discount_t c_t (vs_{t+1} - V_{t+1})``.
    """
    rhos = (target_logprob - behaviour_logprob).exp()
    clipped_rhos = rhos.clamp(max=rho_bar)
    cs = lam * rhos.clamp(max=c_bar)
    next_values = torch.cat([values[1:], bootstrap_value[None]])
    deltas = clipped_rhos * (rewards + discounts * next_values - values)

    vs_minus_v = torch.empty_like(values)
    acc = torch.zeros_like(bootstrap_value)
    for t in reversed(range(values.shape[0])):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = values + vs_minus_v

    next_vs = torch.cat([vs[1:], bootstrap_value[None]])
    pg_advantages = clipped_rhos * (rewards + discounts * next_vs - values)
    return vs, pg_advantages


class VTrace(Algorithm[VTraceSettings]):
    """IMPALA-style actor-critic: V-trace targets correct for the collectors' stale weights."""

    # The behaviour policy's log-prob is what V-trace needs; the value is kept for diagnostics.
    records: ClassVar[dict[str, Record]] = {"logprob": Record(), "value": Record()}
    losses: ClassVar[tuple[str, ...]] = ("pg_loss", "v_loss", "entropy", "rho_mean", "rho_clipfrac")

    @classmethod
    def space_problem(cls, spaces: Spaces) -> str | None:
        """What the model helper cannot handle (its spaces are V-trace's)."""
        return space_problem(spaces)

    def build(self) -> nn.Module:
        """Actor and critic for :attr:`spaces`."""
        return ActorCritic.from_spaces(self.spaces, self.settings.hidden_size)

    def act(
        self, module: nn.Module, obs: Tensor, generator: torch.Generator
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Sample actions; record their log-prob under the behaviour policy and the value."""
        action, logprob, value = cast(ActorCritic, module).act(obs, generator)
        return action, {"logprob": logprob, "value": value}

    def value(self, module: nn.Module, obs: Tensor) -> Tensor | None:
        """V(final obs) for time-limit truncation, when ``bootstrap_truncated``."""
        if not self.settings.bootstrap_truncated:
            return None
        return cast(ActorCritic, module).value(obs)

    def update(
        self, model: nn.Module, module: nn.Module, segments: list[Segment], info: UpdateInfo
    ) -> dict[str, float]:
        """``update_epochs`` x ``num_minibatches`` V-trace steps per segment on ``segments``
        (every trainer takes as many: those of the trainer handed the fewest segments)."""
        s = self.settings
        for group in info.optimizer.param_groups:
            group["lr"] = lr_at(s, info.env_steps)

        # Every segment's env columns side by side: [T, N, ...], N = all collectors' envs.
        def cat(key: str) -> Tensor:
            return torch.cat([seg[key] for seg in segments], dim=1)

        obs, actions, rewards = cat("obs"), cat("actions"), cat("rewards")
        behaviour_logprob = cat("logprob")
        next_obs = torch.cat([seg["next_obs"] for seg in segments])
        next_done = torch.cat([seg["next_done"] for seg in segments])
        discounts = discounts_from_dones(cat("dones"), next_done, s.gamma)
        N = rewards.shape[1]
        minibatches = s.num_minibatches * info.peers.fewest(len(segments))
        columns = N // minibatches

        stats = dict.fromkeys(self.losses, 0.0)
        for _ in range(s.update_epochs):
            perm = torch.randperm(N, generator=info.generator)
            for k in range(minibatches):
                # Whole columns: each minibatch keeps its time sequences for the recursion.
                mb = perm[k * columns : (k + 1) * columns]
                with torch.no_grad():
                    bootstrap_value = cast(ActorCritic, module).value(next_obs[mb])
                loss, parts = self._minibatch_loss(
                    model, obs[:, mb], actions[:, mb], behaviour_logprob[:, mb], rewards[:, mb],
                    discounts[:, mb], bootstrap_value)

                info.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), s.max_grad_norm)
                info.optimizer.step()

                for name, part in parts.items():
                    stats[name] += part.item()

        steps = s.update_epochs * minibatches
        return {name: total / steps for name, total in stats.items()}

    def _minibatch_loss(
        self, model: nn.Module, obs: Tensor, actions: Tensor, behaviour_logprob: Tensor,
        rewards: Tensor, discounts: Tensor, bootstrap_value: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The V-trace loss on whole env columns ([T, n, ...]), and its parts."""
        s = self.settings
        T = rewards.shape[0]
        logprob, entropy, value = (
            x.view(T, -1) for x in model(obs.flatten(0, 1), actions.flatten(0, 1))
        )

        # The targets are constants: V-trace regresses towards them, never through them.
        with torch.no_grad():
            vs, pg_adv = vtrace_targets(
                behaviour_logprob, logprob, rewards, value, bootstrap_value, discounts,
                s.rho_bar, s.c_bar, s.trace_lambda,
            )
            if s.normalize_advantages:
                pg_adv = (pg_adv - pg_adv.mean()) / (pg_adv.std() + 1e-8)
            rhos = (logprob - behaviour_logprob).exp()

        pg_loss = -(pg_adv * logprob).mean()
        v_loss = 0.5 * ((value - vs) ** 2).mean()
        entropy_mean = entropy.mean()
        loss = pg_loss + s.vf_coef * v_loss - s.ent_coef * entropy_mean
        return loss, {"pg_loss": pg_loss, "v_loss": v_loss, "entropy": entropy_mean,
                      "rho_mean": rhos.mean(), "rho_clipfrac": (rhos > s.rho_bar).float().mean()}
