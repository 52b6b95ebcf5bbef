"""Gradients averaged over the trainers that are live now, as each backward pass ends.

DDP binds its process group when it wraps the module; elastic trainers re-form theirs
(app/runtime/trainers/group.py), so their gradients are averaged over the current
TRAIN_DATA_PARALLEL group by a hook instead: DDP's average, at DDP's moment. Each parameter the
optimizer steps gets a post-accumulate-grad hook; the first to fire in a backward pass queues
one callback for the pass's end (torch autograd's execution engine, as DDP's Python reducer and
FSDP do), which sums the gradients in one flat all_reduce and divides them by the number of
trainers: so clipping (``clip_grad_norm_``) and the step see the averaged gradient, bit for bit
DDP's with two trainers (a halving is exact, before the sum or after). When a trainer is lost during that all_reduce, the survivors form
their next group and average the same gradients again over it (rlcomm.collectives runs the
call again from its input): no step keeps a gradient averaged over two groups, and nothing the
update did before (earlier steps, a replay's inserts) is done twice. Averaging is linear, so a
step after two backward passes is averaged as DDP's would be.
"""

from __future__ import annotations

import torch
from torch.autograd import Variable

from rlcomm import CommContext, ParallelMode, collectives

TDP = ParallelMode.TRAIN_DATA_PARALLEL


class AveragedGradients:
    """Averages the gradients of ``optimizer``'s parameters over the live trainers at the end
    of every backward pass that reached them."""

    def __init__(self, ctx: CommContext, optimizer: torch.optim.Optimizer) -> None:
        self.ctx = ctx
        self.params = [p for group in optimizer.param_groups for p in group["params"]
                       if p.requires_grad]
        self.queued = False
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._queue)

    def _queue(self, param: torch.Tensor) -> None:
        if not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(self._average)

    def _average(self) -> None:
        self.queued = False
        # The same parameters have gradients on every trainer: each runs the same pass.
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        collectives.all_reduce(self.ctx, TDP, flat)
        flat.div_(self.ctx.get_world_size(TDP))  # the trainers it completed on
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
