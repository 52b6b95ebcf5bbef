"""PPO on the runtime (CleanRL's ``ppo.py`` / ``ppo_continuous_action.py``): the settings, the
acting module (the runtime's actor-critic for the env's spaces), what a step records (the
behaviour log-probability and value) and the clipped-PPO update. Nothing in here knows about
``torch.distributed``: the update gets the DDP-wrapped model from the runtime.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from app.api import setting
from app.runtime import Algorithm, AlgorithmSettings, Record, Segment, Spaces, UpdateInfo
from app.runtime.core.algorithm import adam
from app.runtime.core.compiling import compiled
from app.runtime.models.actor_critic import ActorCritic, space_problem


@dataclass
class PPOSettings(AlgorithmSettings):
    """PPO settings; defaults are tuned to solve CartPole-v1 quickly on the default layout.

    16 envs x 64 steps per collecting rank, because the per-vector-step overhead dominates
    rollout cost, so more envs is cheaper per env step than longer rollouts. On 2t2r (2,048 env
    steps per update) each optimizer step is a DDP all-reduce, which on a 2-core machine costs
    about as much as the step itself; so 2 minibatches with a larger learning rate (8 steps
    per update) rather than 4 at 2.5e-3 (16), which reach the target in fewer updates. The
    seeds behind that: benchmarks/results/2026-12-02.md.
    """

    gae_lambda: float = setting(0.95, "GAE lambda, in [0, 1]")
    lr: float = setting(7.5e-3, "Adam learning rate (> 0)")
    anneal_lr: bool = setting(True, "anneal the learning rate linearly to 0")
    # Over env steps (all collectors together), so a layout with fewer collectors (smaller
    # updates) anneals over the same amount of experience.
    anneal_env_steps: int = setting(204_800, "env steps over which the learning rate anneals")
    update_epochs: int = setting(4, "passes over each batch")
    # Per trainer, per epoch; fixed by config so all DDP ranks do the same number of optimizer
    # steps.
    num_minibatches: int = setting(2, "minibatches per epoch and trainer")
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
        errors = super().range_errors(batch_per_trainer)
        errors += [f"{name}: must be {want}, got {getattr(self, name)}"
                   for name, ok, want in checks if not ok]
        if not errors and self.num_minibatches > batch_per_trainer:
            errors.append(
                f"num_minibatches: must be at most the {batch_per_trainer} samples each trainer "
                f"gets per update, got {self.num_minibatches}"
            )
        return errors


class PPO(Algorithm[PPOSettings]):
    """Clipped PPO with GAE; decoupled (Hilton et al. 2021) when the data lags the weights."""

    records: ClassVar = {"logprobs": Record(), "values": Record()}
    losses: ClassVar = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac")
    compiles: ClassVar = True

    @classmethod
    def space_problem(cls, spaces: Spaces) -> str | None:
        return space_problem(spaces)

    def build(self) -> nn.Module:
        return ActorCritic.from_spaces(self.spaces, self.settings.hidden_size)

    def act(self, module: nn.Module, obs: Tensor,
            generator: torch.Generator) -> tuple[Tensor, dict[str, Tensor]]:
        action, logprob, value = module.act(obs, generator)  # type: ignore[operator]
        return action, {"logprobs": logprob, "values": value}

    def value(self, module: nn.Module, obs: Tensor) -> Tensor | None:
        return module.value(obs) if self.settings.bootstrap_truncated else None  # type: ignore[operator]

    def optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        return make_optimizer(module, self.settings)

    def update(self, model: nn.Module, module: nn.Module, segments: list[Segment],
               info: UpdateInfo) -> dict[str, float]:
        set_lr(info.optimizer, self.settings, info.env_steps)
        return ppo_update(model, module, info.optimizer, segments, self.settings, info.generator,
                          decoupled=info.lag > 0, loss_fn=self.loss_fn)

    @functools.cached_property
    def loss_fn(self) -> LossFn:
        """The minibatch loss as ``loop.compile`` says (compiled on its first call)."""
        return compiled(minibatch_loss, self.compile_mode, "PPO's minibatch loss")


def compute_gae(
    segment: Segment, next_value: Tensor, gamma: float, lam: float, values: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimates and value targets, both [T, N], with ``values`` [T, N]
    as the baseline (by default the values the segment recorded as it was collected)."""
    rewards, dones = segment["rewards"], segment["dones"]
    values = segment["values"] if values is None else values
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        if t == T - 1:
            next_nonterminal = 1.0 - segment["next_done"]
            next_values = next_value
        else:
            # dones[t+1] says obs[t+1] is a fresh episode, i.e. step t ended one.
            next_nonterminal = 1.0 - dones[t + 1]
            next_values = values[t + 1]
        delta = rewards[t] + gamma * next_values * next_nonterminal - values[t]
        last_gae = delta + gamma * lam * next_nonterminal * last_gae
        advantages[t] = last_gae
    return advantages, advantages + values


def make_optimizer(policy: nn.Module, settings: PPOSettings) -> torch.optim.Adam:
    """Adam with CleanRL's eps=1e-5 (the PyTorch default 1e-8 is less stable for PPO); fused
    where the parameters allow (:func:`adam`)."""
    return adam(policy.parameters(), lr=settings.lr, eps=1e-5)


def lr_at(settings: PPOSettings, env_steps: int) -> float:
    """Learning rate after ``env_steps``: linear decay over ``settings.anneal_env_steps`` if
    annealing."""
    if not settings.anneal_lr:
        return settings.lr
    frac = max(1.0 - env_steps / settings.anneal_env_steps, 0.0)
    return frac * settings.lr


def set_lr(optimizer: torch.optim.Optimizer, settings: PPOSettings, env_steps: int) -> float:
    """Apply :func:`lr_at` to every param group; returns the new learning rate."""
    lr = lr_at(settings, env_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def ppo_update(
    model: nn.Module,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    segments: list[Segment],
    settings: PPOSettings,
    generator: torch.Generator,
    decoupled: bool = False,
    loss_fn: LossFn | None = None,
) -> dict[str, float]:
    """Run ``settings.update_epochs`` x ``num_minibatches`` clipped-PPO steps on ``segments``.

    The behaviour policy is the one that collected the data: its log-probs and values were
    recorded then. With ``decoupled`` (data collected with older weights than ``policy``'s),
    the clip and the value clip are centred on ``policy``'s weights as the update starts (the
    proximal policy), whose values are GAE's baseline too, and each sample's objective is
    weighted by proximal / behaviour probability (decoupled PPO, Hilton et al. 2021): the update
    stays importance-corrected for the behaviour policy while its step is bounded around the
    current weights, not around stale ones (:func:`ppo_batch`).

    ``model`` is ``policy`` or a DDP wrapper around it: losses go through
    ``model(...)`` so gradient all-reduce hooks fire, while the no-grad value
    bootstrap uses ``policy`` directly. The step count depends only on ``settings``,
    so all DDP ranks stay in lockstep (hence no KL early stopping). ``loss_fn``: the
    minibatch loss (:func:`minibatch_loss`, compiled with ``loop.compile``).
    """
    if not segments:
        raise ValueError("ppo_update needs at least one segment")
    batch = ppo_batch(policy, segments, settings, decoupled)
    batch_size = batch.obs.shape[0]
    minibatch_size = batch_size // settings.num_minibatches
    sums: dict[str, Tensor] = {}
    for _ in range(settings.update_epochs):
        perm = torch.randperm(batch_size, generator=generator)
        for k in range(settings.num_minibatches):
            mb = perm[k * minibatch_size : (k + 1) * minibatch_size]
            figures = minibatch_step(model, optimizer, batch.take(mb), settings, loss_fn)
            for name, value in figures.items():
                sums[name] = sums[name] + value if name in sums else value
    n = settings.update_epochs * settings.num_minibatches
    # One read of the figures per update, not five per minibatch step.
    return {k: v / n for k, v in zip(sums, torch.stack(list(sums.values())).tolist(), strict=True)}


def minibatch_step(model: nn.Module, optimizer: torch.optim.Optimizer, mb: PPOBatch,
                   settings: PPOSettings, loss_fn: LossFn | None = None) -> dict[str, Tensor]:
    """One clipped-PPO optimizer step on the minibatch ``mb``: the loss (``loss_fn``, e.g.
    :func:`minibatch_loss` compiled; by default that function as written), its backward, the
    gradient clip and Adam's step. Returns the step's figures as 0-d tensors."""
    loss, figures = (loss_fn or minibatch_loss)(model, mb, settings)
    optimizer.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
    optimizer.step()
    return figures


@dataclass
class PPOBatch:
    """One update's samples, flattened over segments and steps."""

    obs: Tensor
    actions: Tensor
    anchor: Tensor  # the log-probs the clip is centred on
    weight: Tensor | None  # decoupled PPO's proximal / behaviour probability
    advantages: Tensor
    returns: Tensor
    values: Tensor  # the values the value clip is centred on

    def take(self, mb: Tensor) -> PPOBatch:
        """The samples at indices ``mb``."""
        return PPOBatch(self.obs[mb], self.actions[mb], self.anchor[mb],
                        None if self.weight is None else self.weight[mb], self.advantages[mb],
                        self.returns[mb], self.values[mb])


def ppo_batch(policy: nn.Module, segments: list[Segment], settings: PPOSettings,
              decoupled: bool) -> PPOBatch:
    """GAE per segment (bootstrapped from ``policy``'s values), then one flat batch.

    In lockstep the data is ``policy``'s own: the clip and the value clip are centred on the
    log-probs and values recorded as it was collected, and those values are GAE's baseline.
    ``decoupled`` (the data lags ``policy``'s weights): everything is centred on ``policy`` as
    the update starts (the proximal policy): the clip on its log-probs, the value clip on its
    values, which are GAE's baseline too; each sample's objective is weighted by proximal /
    behaviour probability. Centred on the behaviour's recorded values instead, the value clip
    would hold most samples' value loss at its bound from the first step (the critic has moved
    more than ``clip_coef`` since they were recorded), so they would give the critic no
    gradient (docs/async-rollout.md, "A segment that lags the weights").
    """
    obs_l, act_l, logp_l, anchor_l, adv_l, ret_l, val_l = [], [], [], [], [], [], []
    with torch.no_grad():
        for s in segments:
            obs, actions, values = _steps(s["obs"]), _steps(s["actions"]), s["values"]
            logprobs = s["logprobs"].reshape(-1)
            anchor = logprobs
            if decoupled:
                anchor, _, proximal = policy.evaluate(obs, actions)  # type: ignore[operator]
                values = proximal.reshape(values.shape)
            next_value = policy.value(s["next_obs"])  # type: ignore[operator]
            adv, ret = compute_gae(s, next_value, settings.gamma, settings.gae_lambda, values)
            obs_l.append(obs)
            act_l.append(actions)
            logp_l.append(logprobs)
            anchor_l.append(anchor)
            val_l.append(values.reshape(-1))
            adv_l.append(adv.reshape(-1))
            ret_l.append(ret.reshape(-1))
    b_logprobs, b_anchor = torch.cat(logp_l), torch.cat(anchor_l)
    b_weight = (b_anchor - b_logprobs).exp() if decoupled else None
    return PPOBatch(torch.cat(obs_l), torch.cat(act_l), b_anchor, b_weight, torch.cat(adv_l),
                    torch.cat(ret_l), torch.cat(val_l))


def minibatch_loss(model: nn.Module, mb: PPOBatch, settings: PPOSettings
                   ) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped-PPO loss on the minibatch ``mb`` and its figures (0-d tensors, detached)."""
    newlogprob, entropy, newvalue = model(mb.obs, mb.actions)
    logratio = newlogprob - mb.anchor
    ratio = logratio.exp()

    mb_adv = (mb.advantages - mb.advantages.mean()) / (mb.advantages.std() + 1e-8)
    pg_losses = torch.max(
        -mb_adv * ratio, -mb_adv * ratio.clamp(1 - settings.clip_coef, 1 + settings.clip_coef)
    )
    if mb.weight is not None:
        pg_losses = pg_losses * mb.weight
    pg_loss = pg_losses.mean()

    v_unclipped = (newvalue - mb.returns) ** 2
    if settings.clip_vloss:
        v_clipped = mb.values + (newvalue - mb.values).clamp(-settings.clip_coef,
                                                             settings.clip_coef)
        v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - mb.returns) ** 2).mean()
    else:
        v_loss = 0.5 * v_unclipped.mean()

    entropy_loss = entropy.mean()
    loss = pg_loss - settings.ent_coef * entropy_loss + settings.vf_coef * v_loss
    with torch.no_grad():
        figures = {"pg_loss": pg_loss, "v_loss": v_loss, "entropy": entropy_loss,
                   # http://joschu.net/blog/kl-approx.html (k3 estimator)
                   "approx_kl": ((ratio - 1) - logratio).mean(),
                   "clipfrac": ((ratio - 1.0).abs() > settings.clip_coef).float().mean()}
    return loss, {k: v.detach() for k, v in figures.items()}


LossFn = Callable[[nn.Module, PPOBatch, PPOSettings], tuple[Tensor, dict[str, Tensor]]]


def _steps(x: Tensor) -> Tensor:
    """[T, N, *shape] -> [T * N, *shape]."""
    return x.reshape(-1, *x.shape[2:])
