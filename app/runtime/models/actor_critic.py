"""Actor-critic modules chosen from an environment's spaces (PPO's and V-trace's acting module).

- **Observations**: a Box vector goes through tanh MLPs (separate actor and critic, CleanRL's
  PPO); an HxWxC uint8 Box image through the Nature CNN (Mnih et al. 2015), one torso shared by
  both heads (CleanRL's Atari PPO).
- **Actions**: Discrete is a categorical policy; a Box (any shape) is a diagonal Gaussian with a
  learned, state-independent log-std (CleanRL's continuous PPO). Box actions are returned
  unclipped: the runtime clips them to the space before stepping, and the logprob is of the
  unclipped sample.

Vector observations with Discrete actions build exactly the CartPole policy of the PPO loop
before the runtime (its names, construction order, init and ops), so CartPole runs draw and
compute the same numbers as recorded ones (tests/unit/test_models.py keeps a copy to compare with).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from gymnasium import spaces as gym_spaces
from torch import Tensor, nn
from torch.distributions import Categorical, Distribution, Normal

from app.api import setting
from app.runtime.core.algorithm import Spaces

__all__ = [
    "MODEL_KINDS",
    "ActorCritic",
    "ModelConfig",
    "action_dtype",
    "action_shape",
    "is_image",
    "obs_shape",
    "sample",
    "space_problem",
]

_SUPPORTED_OBS = "supported: Box vectors, HxWxC uint8 images"
_SUPPORTED_ACTIONS = "supported: Discrete, Box"
# The Nature CNN's convolutions: (out channels, kernel, stride).
_NATURE_CONVS = ((32, 8, 4), (64, 4, 2), (64, 3, 1))
_NATURE_HIDDEN = 512
_MIN_IMAGE_SIDE = 36  # the smallest side the three convolutions leave at least 1x1 of
_Layer = TypeVar("_Layer", nn.Linear, nn.Conv2d)


def is_image(space: Any) -> bool:
    """Whether an observation space is taken as an image: a Box with three dimensions (HxWxC)."""
    return isinstance(space, gym_spaces.Box) and len(space.shape) == 3


def space_problem(spaces: Spaces) -> str | None:
    """Why :class:`ActorCritic` cannot handle ``spaces``, or None. One line that follows
    ``loop.env.id: <id> has ...``, e.g. ``observation space Dict(...) is not supported (...)``."""
    obs, act = spaces.observation, spaces.action
    if not isinstance(obs, gym_spaces.Box) or len(obs.shape) not in (0, 1, 3):
        return f"observation space {obs} is not supported ({_SUPPORTED_OBS})"
    if is_image(obs):
        if obs.dtype != np.uint8:
            return (f"observation space {obs} is not supported: a 3-dimensional Box is taken as "
                    f"an HxWxC image, which must have dtype uint8, not {obs.dtype} "
                    f"({_SUPPORTED_OBS})")
        if min(obs.shape[:2]) < _MIN_IMAGE_SIDE:
            return (f"observation space {obs} is too small for the Nature CNN: images need at "
                    f"least {_MIN_IMAGE_SIDE}x{_MIN_IMAGE_SIDE} pixels (HxWxC)")
    if isinstance(act, gym_spaces.Discrete):
        if int(act.start) != 0:
            # The policy samples 0..n-1 and the runtime steps the env with that index as is.
            return (f"action space {act} is not supported: a Discrete action space must start "
                    f"at 0, not {int(act.start)}")
        return None
    if isinstance(act, gym_spaces.Box):
        if not np.issubdtype(act.dtype, np.floating):
            return (f"action space {act} is not supported: a Box action space must have a float "
                    f"dtype for the Gaussian policy, not {act.dtype}")
        return None
    return f"action space {act} is not supported ({_SUPPORTED_ACTIONS})"


def obs_shape(spaces: Spaces) -> tuple[int, ...]:
    """One env's observation shape, as the env returns it (HxWxC for images)."""
    return tuple(int(d) for d in spaces.observation.shape)


def action_shape(spaces: Spaces) -> tuple[int, ...]:
    """One env's action shape: () for Discrete, the space's shape for Box."""
    if isinstance(spaces.action, gym_spaces.Discrete):
        return ()
    return tuple(int(d) for d in spaces.action.shape)


def action_dtype(spaces: Spaces) -> torch.dtype:
    """How to store actions: int64 for Discrete, float32 for Box."""
    return torch.int64 if isinstance(spaces.action, gym_spaces.Discrete) else torch.float32


def _layer_init(layer: _Layer, std: float = math.sqrt(2), bias: float = 0.0) -> _Layer:
    """Orthogonal weights and constant bias, as in CleanRL."""
    nn.init.orthogonal_(layer.weight, std)
    assert layer.bias is not None  # every layer here has one
    nn.init.constant_(layer.bias, bias)
    return layer


def _mlp(in_dim: int, hidden_size: int, out_dim: int, out_std: float) -> nn.Sequential:
    """Two tanh hidden layers and a linear output, CleanRL's PPO MLP."""
    return nn.Sequential(
        _layer_init(nn.Linear(in_dim, hidden_size)),
        nn.Tanh(),
        _layer_init(nn.Linear(hidden_size, hidden_size)),
        nn.Tanh(),
        _layer_init(nn.Linear(hidden_size, out_dim), std=out_std),
    )


def _nature_cnn(height: int, width: int, channels: int) -> nn.Sequential:
    """The Nature CNN on CHW floats in [0, 1]: three ReLU convolutions, then linear 512, ReLU."""
    layers: list[nn.Module] = []
    in_channels = channels
    for out_channels, kernel, stride in _NATURE_CONVS:
        layers += [_layer_init(nn.Conv2d(in_channels, out_channels, kernel, stride)), nn.ReLU()]
        in_channels = out_channels
    layers.append(nn.Flatten())
    convs = nn.Sequential(*layers)
    # A forward pass draws no random numbers, so every rank's init stays alike.
    with torch.no_grad():
        flat = int(convs(torch.zeros(1, channels, height, width)).shape[1])
    return nn.Sequential(
        *layers, _layer_init(nn.Linear(flat, _NATURE_HIDDEN)), nn.ReLU()
    )


def _grads_in_param_strides(module: nn.Module) -> None:
    """Give every parameter of ``module`` with a size-1 dimension its gradient in its own strides.

    The Nature CNN's first convolution on a 1-channel image (weight [32, 1, 8, 8]) gets its
    weight gradient from oneDNN in channels_last strides, because its input (``_features``'
    permuted HWC view) has channels_last strides: (64, 1, 8, 1), not the weight's (64, 64, 8,
    1). The two differ only in the size-1 dimension, whose stride addresses nothing, so autograd
    keeps the gradient as is (its layout contract ignores size-1 dimensions), but DDP's reducer
    compares strides exactly and warns "Grad strides do not match bucket view strides" on every
    trainer. This hook hands such a gradient on as a view with the parameter's strides: the same
    memory and values (no copy), so DDP and the optimizer see the parameter's layout. Gradients
    whose strides differ in a dimension of size > 1 pass untouched (autograd copies those into
    the parameter's layout itself). Parameters without a size-1 dimension get no hook.
    """
    for param in module.parameters():
        if param.requires_grad and param.dim() > 1 and 1 in param.shape:
            param.register_hook(_restride_hook(weakref.ref(param)))


def _restride_hook(param_ref: weakref.ref[nn.Parameter]) -> Any:
    """The gradient hook of :func:`_grads_in_param_strides` (a weak reference: no cycle)."""

    def restride(grad: Tensor) -> Tensor:
        param = param_ref()
        if param is None or grad.shape != param.shape or grad.stride() == param.stride():
            return grad
        if any(n != 1 and g != p for n, g, p in zip(grad.shape, grad.stride(), param.stride())):
            return grad
        return grad.as_strided(grad.shape, param.stride())

    return restride


def sample(dist: Distribution, generator: torch.Generator,
           action_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """(action, logprob) drawn from a policy's distribution with ``generator`` only (never the
    global RNG): an index of a Categorical, or an unclipped Gaussian sample shaped
    [N, *action_shape] whose logprob sums over the action's dimensions."""
    if isinstance(dist, Categorical):
        # Categorical.sample() takes no generator; multinomial does (the pre-runtime op).
        action = torch.multinomial(dist.probs, 1, generator=generator).squeeze(-1)
        return action, dist.log_prob(action)
    assert isinstance(dist, Normal)
    flat = torch.normal(dist.loc, dist.scale, generator=generator)
    return flat.reshape(*flat.shape[:-1], *action_shape), dist.log_prob(flat).sum(-1)


def mode(dist: Distribution, action_shape: tuple[int, ...]) -> Tensor:
    """The deterministic action of a policy's distribution: a Categorical's most probable index,
    or a Gaussian's mean shaped [N, *action_shape] (unclipped, as :func:`sample`'s)."""
    if isinstance(dist, Categorical):
        return dist.logits.argmax(-1)
    assert isinstance(dist, Normal)
    return dist.loc.reshape(*dist.loc.shape[:-1], *action_shape)


class ActorCritic(nn.Module):
    """A policy and a state value for one pair of spaces (see the module docstring).

    Vector observations: ``critic`` and ``actor`` tanh MLPs, built in that order. Images:
    ``torso`` (the Nature CNN), then ``critic`` and ``actor`` linear heads. Box actions add
    ``actor_logstd`` [1, act_dim], starting at 0. ``forward(obs, action)`` is :meth:`evaluate`,
    the training path, so DDP's hooks fire.
    """

    def __init__(self, spaces: Spaces, hidden_size: int = 64) -> None:
        super().__init__()
        problem = space_problem(spaces)
        if problem is not None:
            raise ValueError(problem)
        self.image = is_image(spaces.observation)
        self.discrete = isinstance(spaces.action, gym_spaces.Discrete)
        self.obs_shape = obs_shape(spaces)
        self.action_shape = action_shape(spaces)
        out_dim = int(spaces.action.n) if self.discrete else math.prod(self.action_shape)
        if self.image:
            height, width, channels = self.obs_shape
            self.torso = _nature_cnn(height, width, channels)
            _grads_in_param_strides(self.torso)  # 1-channel images: see there (DDP's warning)
            self.critic: nn.Module = _layer_init(nn.Linear(_NATURE_HIDDEN, 1), std=1.0)
            self.actor: nn.Module = _layer_init(nn.Linear(_NATURE_HIDDEN, out_dim), std=0.01)
        else:
            obs_dim = math.prod(self.obs_shape)
            # Critic first, then actor: the orthogonal inits draw from the global RNG in the
            # order the pre-runtime CartPole policy did. The actor's small std gives a
            # near-uniform (or near-zero mean) initial policy.
            self.critic = _mlp(obs_dim, hidden_size, 1, out_std=1.0)
            self.actor = _mlp(obs_dim, hidden_size, out_dim, out_std=0.01)
        if not self.discrete:
            self.actor_logstd = nn.Parameter(torch.zeros(1, out_dim))

    @classmethod
    def from_spaces(cls, spaces: Spaces, hidden_size: int) -> ActorCritic:
        """The module for ``spaces``; raises ValueError with :func:`space_problem`'s reason."""
        return cls(spaces, hidden_size)

    def _features(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        """(actor input, critic input) for observations [*B, *obs_shape]."""
        if self.image:
            lead = obs.shape[: obs.dim() - 3]
            # uint8 HWC in [0, 255] -> float CHW in [0, 1]; float input is taken as raw pixels too.
            x = obs.reshape(-1, *self.obs_shape).float().div(255.0).permute(0, 3, 1, 2)
            h = self.torso(x).reshape(*lead, _NATURE_HIDDEN)
            return h, h
        if obs.dtype != torch.float32:
            obs = obs.float()
        if len(self.obs_shape) != 1:  # a scalar Box: one feature; 1-D stays untouched (exact)
            obs = obs.reshape(*obs.shape[: obs.dim() - len(self.obs_shape)], -1)
        return obs, obs

    def _dist(self, actor_in: Tensor) -> Distribution:
        """The action distribution; a Gaussian's over the flattened action [*B, act_dim]."""
        # Skipping argument validation noticeably speeds up the per-step rollout path.
        if self.discrete:
            return Categorical(logits=self.actor(actor_in), validate_args=False)
        mean = self.actor(actor_in)
        std = self.actor_logstd.expand_as(mean).exp()
        return Normal(mean, std, validate_args=False)

    def _flat_action(self, action: Tensor) -> Tensor:
        """Box actions [*B, *action_shape] as [*B, act_dim]."""
        lead = action.shape[: action.dim() - len(self.action_shape)]
        return action.reshape(*lead, -1)

    def value(self, obs: Tensor) -> Tensor:
        """State values [*B]."""
        return self.critic(self._features(obs)[1]).squeeze(-1)

    def act(self, obs: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """(action, logprob, value) for observations [N, *obs_shape], sampled with ``generator``
        only (never the global RNG). Box actions are unclipped, shaped [N, *action_shape]."""
        actor_in, critic_in = self._features(obs)
        dist = self._dist(actor_in)
        action, logprob = sample(dist, generator, self.action_shape)
        return action, logprob, self.critic(critic_in).squeeze(-1)

    def greedy(self, obs: Tensor) -> Tensor:
        """The deterministic action for observations [N, *obs_shape] (:func:`mode`)."""
        return mode(self._dist(self._features(obs)[0]), self.action_shape)

    def evaluate(self, obs: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(logprob, entropy, value) of ``action`` [*B, *action_shape] at ``obs``, each [*B]."""
        actor_in, critic_in = self._features(obs)
        dist = self._dist(actor_in)
        if self.discrete:
            logprob, entropy = dist.log_prob(action), dist.entropy()
        else:
            logprob = dist.log_prob(self._flat_action(action)).sum(-1)
            entropy = dist.entropy().sum(-1)
        return logprob, entropy, self.critic(critic_in).squeeze(-1)

    def forward(self, obs: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`evaluate`: the training path through DDP."""
        return self.evaluate(obs, action)


MODEL_KINDS = ("mlp", "transformer")


@dataclass
class ModelConfig:
    """``loop.model``: which policy the runtime trains (the algorithm's own, or a transformer
    that attends over each env's recent observations)."""

    kind: str = setting(
        "mlp", "mlp: the algorithm's own module (tanh MLPs; the Nature CNN for images); "
        "transformer: attends over the last `context` steps (vector observations)"
    )
    width: int = setting(64, "transformer: model width (divisible by heads)")
    layers: int = setting(2, "transformer: blocks")
    heads: int = setting(4, "transformer: attention heads (divisible by tensor_parallel_size)")
    context: int = setting(8, "transformer: past steps the policy attends to, this one included "
                              "(divisible by layout.sequence_parallel_size)")

    @property
    def history(self) -> int:
        """Steps of observations a collector keeps per env for the policy (0: just the last)."""
        return self.context if self.kind == "transformer" else 0

    def range_errors(self) -> list[str]:
        """``field: must be ..., got value`` for each setting out of range."""
        if self.kind not in MODEL_KINDS:
            return [f"kind: must be one of {', '.join(MODEL_KINDS)}, got {self.kind!r}"]
        if self.kind != "transformer":
            return []
        errors = [f"{name}: must be a positive integer, got {getattr(self, name)}"
                  for name in ("width", "layers", "heads", "context") if getattr(self, name) < 1]
        if not errors and self.width % self.heads:
            errors.append(f"width: must be divisible by heads ({self.heads}), got {self.width}")
        return errors

