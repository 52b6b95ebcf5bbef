"""Running normalisation of observations and rewards, with statistics that travel as weights.

The statistics are buffers of an ``nn.Module``, so they are checkpointed with its state dict and
ride rlcomm's weight transfer, which binds every parameter and buffer into its send buffer and
then points the tensors at views of it. Hence the rule here: a buffer is never reassigned, only
updated in place (``copy_``), or the transfer would keep sending the old tensor.

Moments vectors are float64 ``[count, mean..., M2...]`` (M2: the sum of squared deviations from
the mean), so a rollout can summarise what it saw and a trainer can fold any number of them in
with Chan et al.'s parallel algorithm, the update of gymnasium's ``RunningMeanStd``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["ReturnTracker", "RunningNorm"]

EPSILON = 1e-8  # under the square root, gymnasium's NormalizeObservation/NormalizeReward default


class RunningNorm(nn.Module):
    """Running mean and variance of values of shape ``shape`` (gymnasium's ``RunningMeanStd``).

    Buffers (float64): ``mean`` and ``var`` of ``shape`` (starting at 0 and 1), ``count`` (a
    scalar starting at ``epsilon``, 1e-4 as in gymnasium, so the first merge needs no special
    case).
    """

    mean: Tensor
    var: Tensor
    count: Tensor

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = 1e-4) -> None:
        super().__init__()
        self.shape = tuple(int(d) for d in shape)
        self.register_buffer("mean", torch.zeros(self.shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(self.shape, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(epsilon, dtype=torch.float64))

    @staticmethod
    def moments_size(shape: tuple[int, ...]) -> int:
        """Elements of one moments vector for values of ``shape``: count, mean, M2."""
        return 1 + 2 * math.prod(shape)

    @staticmethod
    def batch_moments(x: Tensor, shape: tuple[int, ...] = ()) -> Tensor:
        """The moments vector of a batch: ``x`` [*leading, *shape] is flattened over its
        leading dims (for observations [T, N, *obs], pass ``shape`` = the obs shape)."""
        size = math.prod(shape)
        flat = x.detach().reshape(-1, size).to(torch.float64)
        count = flat.shape[0]
        if count == 0:  # nothing seen: a vector that merges as a no-op
            return torch.zeros(1 + 2 * size, dtype=torch.float64, device=x.device)
        mean = flat.mean(0)
        m2 = (flat - mean).square().sum(0)
        return torch.cat([mean.new_tensor([count]), mean, m2])

    @staticmethod
    def combine(a: Tensor, b: Tensor) -> Tensor:
        """The moments vector of the union of two batches given as moments vectors ``a``, ``b``
        (Chan et al.; an empty batch, count 0, leaves the other unchanged)."""
        size = (a.numel() - 1) // 2
        count_a, mean_a, m2_a = a[0], a[1 : 1 + size], a[1 + size :]
        count_b, mean_b, m2_b = b[0], b[1 : 1 + size], b[1 + size :]
        count = count_a + count_b
        # Two empty batches: any positive divisor keeps the zeros (and no NaN).
        total = count.clamp(min=torch.finfo(torch.float64).tiny)
        delta = mean_b - mean_a
        mean = mean_a + delta * count_b / total
        m2 = m2_a + m2_b + delta.square() * count_a * count_b / total
        return torch.cat([count.reshape(1), mean, m2])

    @torch.no_grad()
    def merge(self, moments: Tensor) -> None:
        """Fold one moments vector, or several ([K, size]), into the statistics, in place."""
        size = self.moments_size(self.shape)
        if moments.shape[-1] != size:
            raise ValueError(f"moments of {moments.shape[-1]} elements for statistics of shape "
                             f"{self.shape}, which need {size}")
        rows = moments.detach().to(device=self.count.device, dtype=torch.float64).reshape(-1, size)
        batch = rows[0]
        for row in rows[1:]:
            batch = self.combine(batch, row)
        own = torch.cat([self.count.reshape(1), self.mean.reshape(-1),
                         (self.var * self.count).reshape(-1)])
        new = self.combine(own, batch)
        n = math.prod(self.shape)
        # In place: the weight transfer and the checkpoint hold these very tensors.
        self.count.copy_(new[0])
        self.mean.copy_(new[1 : 1 + n].reshape(self.shape))
        self.var.copy_((new[1 + n :] / new[0]).reshape(self.shape))

    def normalize(self, x: Tensor, clip: float) -> Tensor:
        """``clip((x - mean) / sqrt(var + 1e-8), -clip, clip)`` as float32."""
        return ((x - self.mean) / torch.sqrt(self.var + EPSILON)).clamp(-clip, clip).float()

    def scale(self, rewards: Tensor, clip: float) -> Tensor:
        """Rewards divided by the running std of the discounted return (shape () statistics of
        :class:`ReturnTracker`'s moments), ``clip(r / sqrt(var + 1e-8), -clip, clip)``, float32."""
        if self.shape != ():
            raise ValueError(f"scale needs scalar statistics, these have shape {self.shape}")
        return (rewards / torch.sqrt(self.var + EPSILON)).clamp(-clip, clip).float()


class ReturnTracker:
    """The rollout side of reward scaling (gymnasium's ``NormalizeReward``, CleanRL): each env's
    discounted return, whose batch moments the trainer merges into a ``RunningNorm(())``.

    Per step, as gymnasium 1.x's vector ``NormalizeReward`` with SAME_STEP autoreset (the
    runtime's): ``ret = ret * gamma * (1 - terminated) + reward``, the statistics see ``ret``,
    then ``ret`` restarts at 0 where the episode ended (terminated or truncated).

    Its state (the running returns) is not checkpointed: after a resume they restart at 0, as
    for a freshly wrapped env; only the statistics, in the module, are restored.
    """

    def __init__(self, num_envs: int, gamma: float) -> None:
        self.gamma = gamma
        self.returns = torch.zeros(num_envs, dtype=torch.float64)
        self._seen: list[Tensor] = []  # the returns since the last take_moments

    def step(self, rewards: Tensor, terminated: Tensor, truncated: Tensor | None = None) -> None:
        """Accumulate one vector step's ``rewards`` [N]; ``terminated``/``truncated`` [N]: this
        step ended the episode (``truncated`` None: no time-limit cuts, returns then carry over
        a truncation)."""
        term = terminated.to(torch.float64)
        self.returns = self.returns * self.gamma * (1 - term) + rewards.to(torch.float64)
        self._seen.append(self.returns)
        ended = term.bool() if truncated is None else term.bool() | truncated.bool()
        # Out of place: the tensor just appended to _seen keeps this step's returns.
        self.returns = self.returns.masked_fill(ended, 0.0)

    def take_moments(self) -> Tensor:
        """The moments vector (shape ()) of every return seen since the last call; clears them."""
        seen = torch.cat(self._seen) if self._seen else self.returns.new_zeros(0)
        self._seen.clear()
        return RunningNorm.batch_moments(seen)
