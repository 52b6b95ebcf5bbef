"""Gradients averaged over the trainers that are live now, before every optimizer step.

DDP binds its process group when it wraps the module; elastic trainers re-form theirs
(app/runtime/trainers/group.py), so their gradients are averaged by an optimizer step pre-hook
over the current TRAIN_DATA_PARALLEL group instead: DDP's average (the sum over the trainers
divided by their number), in one flat all_reduce per step. When a trainer is lost during that
all_reduce, the survivors form their next group and average the same step's gradients again over
it (rlcomm.collectives runs the call again from its input): no step keeps a gradient averaged over
two groups, and nothing the update already did (a replay's inserts, earlier steps) is done twice.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcomm import CommContext, ParallelMode, collectives

TDP = ParallelMode.TRAIN_DATA_PARALLEL


class AveragedGradients:
    """Averages the gradients of ``optimizer``'s parameters over the live trainers before each
    of its steps."""

    def __init__(self, ctx: CommContext, optimizer: torch.optim.Optimizer) -> None:
        self.ctx = ctx
        self.handle = optimizer.register_step_pre_hook(self._average)

    def _average(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # The same parameters have gradients on every trainer: each runs the same step.
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        collectives.all_reduce(self.ctx, TDP, flat)  # over whichever trainers it completed on
        flat /= self.ctx.get_world_size(TDP)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
