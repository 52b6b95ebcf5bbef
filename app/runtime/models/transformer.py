"""A transformer actor-critic over a window of recent observations, with its tensor-parallel plan.

The policy sees the last ``context`` observations of one env, oldest first, each with a validity
flag (what :class:`app.runtime.envs.history.ObsHistory` keeps): ``[*B, context, obs_dim + 1]``.
Pre-norm blocks with SwiGLU feed-forwards (named as torchtitan's Llama, so the plan reads alike)
attend over the valid steps only; the actor and critic heads read the newest position. Its
public methods are :class:`app.runtime.models.actor_critic.ActorCritic`'s.

:meth:`TransformerActorCritic.context_parallel` splits the window over a SEQUENCE_PARALLEL group
(context parallelism, for training): each rank runs the blocks on its contiguous chunk, its
queries attend to the whole window's keys and values (:func:`gather_window`), and the newest
position, on the last chunk, reaches every rank's heads.

Its tensor-parallel plan lives in :mod:`app.runtime.models.transformer_tp`, imported only where
a grid splits the model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gymnasium import spaces as gym_spaces
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributions import Categorical, Distribution, Normal

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

from app.runtime.core.algorithm import Spaces
from app.runtime.models.actor_critic import action_shape, mode, sample, space_problem

__all__ = [
    "TransformerActorCritic",
    "check_tensor_parallel",
    "ffn_hidden",
    "gather_window",
    "transformer_space_problem",
]

_INIT_STD = 0.02  # GPT-2's std for the blocks' projections and the position table
_HIDDEN_MULTIPLE = 8  # the feed-forward width is a multiple of this: any tp size dividing it fits
SEQ_DIM = 1  # the blocks run on [B, context, width]


def transformer_space_problem(spaces: Spaces) -> str | None:
    """Why :class:`TransformerActorCritic` cannot handle ``spaces``, or None; one line, as
    :func:`app.runtime.models.actor_critic.space_problem`."""
    obs = spaces.observation
    if not isinstance(obs, gym_spaces.Box) or len(obs.shape) != 1:
        return (f"observation space {obs} is not supported by the transformer policy "
                f"(supported: 1-D Box vectors)")
    return space_problem(spaces)  # the observation passes there: this is about the action


def ffn_hidden(width: int) -> int:
    """The SwiGLU feed-forward's hidden width for ``width``: Llama's 8/3 * width (as many
    weights as a 4x MLP), rounded up to a multiple of 8."""
    return _HIDDEN_MULTIPLE * math.ceil(8 * width / 3 / _HIDDEN_MULTIPLE)


def check_tensor_parallel(width: int, heads: int, hidden: int, tp: int, *,
                          context: int | None = None) -> str | None:
    """Which size does not split over ``tp`` ranks, as one line, or None. ``context``: the
    window, checked only when given (sequence parallelism shards it)."""
    if tp < 1:
        return f"tensor_parallel_size must be at least 1, got {tp}"
    if heads < 1 or width % heads:
        return f"width {width} is not divisible by heads {heads}"
    sizes = [("heads", heads), ("hidden", hidden)]
    if context is not None:
        # Sharded activations are rebuilt from local shards assuming equal parts.
        sizes.append(("context", context))
    for name, size in sizes:
        if size % tp:
            return f"{name} {size} is not divisible by tensor_parallel_size {tp}"
    return None


class _GatherWindow(torch.autograd.Function):
    """All-gather along the window, whose backward reduce-scatters (sums) the gradient. torch's
    ``torch.distributed.nn.functional.all_gather`` is not used: on gloo its backward scatters
    from group ranks taken as global ranks, which fails in any group without rank 0."""

    @staticmethod
    def forward(ctx: Any, part: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts, dim=SEQ_DIM)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        chunks = [c.contiguous() for c in grad.chunk(dist.get_world_size(ctx.group), SEQ_DIM)]
        mine = torch.empty_like(chunks[0])
        dist.reduce_scatter(mine, chunks, group=ctx.group)
        return mine, None


def gather_window(part: Tensor, group: ProcessGroup) -> Tensor:
    """The whole window [B, context, ...] from each SEQUENCE_PARALLEL rank's chunk ``part``
    [B, context / size, ...], in group-rank order. Its backward sums every rank's gradient of a
    chunk into the chunk's owner (a reduce-scatter): each rank's loss reaches the keys and values
    of every chunk it attended to, which is what makes the replica's gradient, averaged over
    data x sequence, the unsplit model's."""
    gathered: Tensor = _GatherWindow.apply(part, group)
    return gathered


def _layer_init(layer: nn.Linear, std: float) -> nn.Linear:
    """Orthogonal weights and zero bias, as ActorCritic's heads (CleanRL)."""
    nn.init.orthogonal_(layer.weight, std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


def _projection(in_dim: int, out_dim: int, std: float) -> nn.Linear:
    layer = nn.Linear(in_dim, out_dim, bias=False)
    nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
    return layer


class Attention(nn.Module):
    """Multi-head self-attention over the window, never attending to padding."""

    def __init__(self, width: int, heads: int, out_std: float) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.wq = _projection(width, width, _INIT_STD)
        self.wk = _projection(width, width, _INIT_STD)
        self.wv = _projection(width, width, _INIT_STD)
        self.wo = _projection(width, width, out_std)
        # Context parallelism (TransformerActorCritic.context_parallel): x is this rank's chunk
        # of the window, the keys and values are gathered whole.
        self.sequence_group: ProcessGroup | None = None
        self.gather = gather_window

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        """``x`` [B, S, width], ``keep`` [B, context] (the keys that may be attended) ->
        [B, S, width]; S is the context, or under context parallelism this rank's chunk."""
        batch, seq = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism wq/wk/wv return this rank's heads only.
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.sequence_group is not None:
            k, v = self.gather(k, self.sequence_group), self.gather(v, self.sequence_group)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=keep[:, None, None, :])
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, width: int, hidden: int, out_std: float) -> None:
        super().__init__()
        self.w1 = _projection(width, hidden, _INIT_STD)
        self.w2 = _projection(hidden, width, out_std)
        self.w3 = _projection(width, hidden, _INIT_STD)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, width: int, heads: int, hidden: int, out_std: float) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = Attention(width, heads, out_std)
        self.ffn_norm = nn.LayerNorm(width)
        self.feed_forward = FeedForward(width, hidden, out_std)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), keep)
        return x + self.feed_forward(self.ffn_norm(x))


class Positions(nn.Module):
    """A learned embedding of each window position, added to the steps' features."""

    def __init__(self, context: int, width: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.empty(context, width))
        nn.init.trunc_normal_(self.table, std=_INIT_STD, a=-2 * _INIT_STD, b=2 * _INIT_STD)

    def forward(self, h: Tensor, start: int | None = None) -> Tensor:
        """``h`` [B, context, width]; with ``start``, a chunk of the window from that position."""
        if start is None:
            return h + self.table
        return h + self.table[start : start + h.shape[SEQ_DIM]]


class LogStd(nn.Module):
    """A Gaussian policy's state-independent log standard deviation [1, act_dim]."""

    def __init__(self, act_dim: int) -> None:
        super().__init__()
        self.log_std = nn.Parameter(torch.zeros(1, act_dim))

    def forward(self, mean: Tensor) -> Tensor:
        """The standard deviation, shaped as ``mean``."""
        return self.log_std.expand_as(mean).exp()


class TransformerActorCritic(nn.Module):
    """A policy and a state value from a window of observations (see the module docstring).

    Observations are ``[*B, context, obs_dim + 1]`` (:attr:`history_shape`), oldest first, the
    last feature 1.0 for a real step and 0.0 for padding. Actions as
    :class:`app.runtime.models.actor_critic.ActorCritic`: Discrete is categorical, Box a diagonal
    Gaussian with a state-independent ``actor_logstd`` [1, act_dim], sampled unclipped.
    ``forward(obs, action)`` is :meth:`evaluate`. Every parameter is drawn from the global RNG
    in construction order, so ranks that seed alike build the same weights.
    """

    seq_dim: ClassVar[int] = SEQ_DIM  # the window's dimension, for the tensor-parallel plan

    def __init__(self, spaces: Spaces, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        problem = transformer_space_problem(spaces)
        if problem is not None:
            raise ValueError(problem)
        problem = check_tensor_parallel(width, heads, ffn_hidden(width), 1)
        if problem is None and (layers < 1 or context < 1):
            problem = f"layers {layers} and context {context} must both be at least 1"
        if problem is not None:
            raise ValueError(problem)
        self.discrete = isinstance(spaces.action, gym_spaces.Discrete)
        self.action_shape = action_shape(spaces)
        obs_dim = int(math.prod(spaces.observation.shape))
        self.history_shape = (context, obs_dim + 1)
        self.width, self.heads, self.hidden = width, heads, ffn_hidden(width)
        out_dim = int(spaces.action.n) if self.discrete else math.prod(self.action_shape)

        self.embed = nn.Linear(obs_dim + 1, width)  # PyTorch's init: raw observations in
        self.pos = Positions(context, width)
        # GPT-2: the projections into the residual stream shrink with depth.
        out_std = _INIT_STD / math.sqrt(2 * layers)
        self.layers = nn.ModuleList(
            Block(width, heads, self.hidden, out_std) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        # Critic first, then actor, as ActorCritic; the actor's small std gives a near-uniform
        # (or near-zero mean) initial policy.
        self.critic = _layer_init(nn.Linear(width, 1), std=1.0)
        self.actor = _layer_init(nn.Linear(width, out_dim), std=0.01)
        if not self.discrete:
            self.actor_std = LogStd(out_dim)
        self.sequence_group: ProcessGroup | None = None  # context_parallel's

    def context_parallel(self, group: ProcessGroup) -> None:
        """Split the window over ``group`` (SEQUENCE_PARALLEL) from now on: rank i of the group
        runs the blocks on the i-th contiguous chunk (its positions from the chunk's start),
        attending to the whole window's keys and values, gathered over ``group`` with autograd;
        the newest position, on the last chunk, is gathered the same way, so every rank of the
        group computes the same outputs (and losses). Every rank of ``group`` must run each
        forward and backward. The training copy only: acting stays whole."""
        parts = dist.get_world_size(group)
        if self.history_shape[0] % parts:
            raise ValueError(f"context {self.history_shape[0]} is not divisible by "
                             f"sequence_parallel_size {parts}")
        self.sequence_group = group
        for layer in self.layers:
            layer.attention.sequence_group = group  # type: ignore[union-attr]

    def _features(self, obs: Tensor) -> Tensor:
        """The newest position's features [*B, width] for windows [*B, context, obs_dim + 1]."""
        if tuple(obs.shape[-2:]) != self.history_shape:
            raise ValueError(f"observations must be [*B, {self.history_shape[0]}, "
                             f"{self.history_shape[1]}], got {list(obs.shape)}")
        lead = obs.shape[:-2]
        # One batch dim: the blocks (and sequence parallelism) take the window as dim 1.
        x = obs.reshape(-1, *self.history_shape).float()
        keep = x[..., -1] > 0.5
        keep[:, -1] = True  # the newest step is real: every query has a key
        if self.sequence_group is not None:
            return self._chunk_features(x, keep, self.sequence_group).reshape(*lead, self.width)
        h = self.pos(self.embed(x))
        for layer in self.layers:
            h = layer(h, keep)
        # A layer norm is per position: normalising the newest alone is the same.
        return self.norm(h[:, -1]).reshape(*lead, self.width)

    def _chunk_features(self, x: Tensor, keep: Tensor, group: ProcessGroup) -> Tensor:
        """:meth:`_features` under context parallelism, for windows ``x`` [B, context, ...]:
        this rank's chunk through the blocks, then the newest position's features [B, width]
        from the last chunk, the same on every rank of ``group``."""
        size = self.history_shape[0] // dist.get_world_size(group)
        start = dist.get_rank(group) * size
        h = self.pos(self.embed(x[:, start : start + size]), start)
        for layer in self.layers:
            h = layer(h, keep)
        # Every rank's loss flows back into the last chunk (the gather's backward sums).
        return self.norm(gather_window(h[:, -1:], group)[:, -1])

    def _dist(self, features: Tensor) -> Distribution:
        if self.discrete:
            return Categorical(logits=self.actor(features), validate_args=False)
        mean = self.actor(features)
        return Normal(mean, self.actor_std(mean), validate_args=False)

    def value(self, obs: Tensor) -> Tensor:
        """State values [*B]."""
        return self.critic(self._features(obs)).squeeze(-1)

    def act(self, obs: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        """(action, logprob, value) for windows [N, context, obs_dim + 1], sampled with
        ``generator`` only. Box actions are unclipped, shaped [N, *action_shape]."""
        features = self._features(obs)
        dist = self._dist(features)
        action, logprob = sample(dist, generator, self.action_shape)
        return action, logprob, self.critic(features).squeeze(-1)

    def greedy(self, obs: Tensor) -> Tensor:
        """The deterministic action for windows [N, context, obs_dim + 1] (:func:`mode`)."""
        return mode(self._dist(self._features(obs)), self.action_shape)

    def evaluate(self, obs: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(logprob, entropy, value) of ``action`` [*B, *action_shape] at ``obs``, each [*B]."""
        features = self._features(obs)
        dist = self._dist(features)
        if self.discrete:
            logprob, entropy = dist.log_prob(action), dist.entropy()
        else:
            flat = action.reshape(*action.shape[: action.dim() - len(self.action_shape)], -1)
            logprob, entropy = dist.log_prob(flat).sum(-1), dist.entropy().sum(-1)
        return logprob, entropy, self.critic(features).squeeze(-1)

    def forward(self, obs: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`evaluate`: the training path."""
        return self.evaluate(obs, action)

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """The runtime's plan for this policy (app/runtime/trainer/trained.py): the blocks split as
        :func:`app.runtime.models.transformer_tp.tensor_parallel_plan` does, every other part
        replicated."""
        from app.runtime.models.transformer_tp import tensor_parallel_plan

        return tensor_parallel_plan(self, replicate_rest=True)
