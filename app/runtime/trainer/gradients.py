"""Gradients averaged over the trainers that are live now, as each backward pass ends
(sharded trainers in replica groups: :class:`AveragedAcrossReplicas`).

DDP binds its process group when it wraps the module; elastic trainers re-form theirs
(app/runtime/membership/trainers.py), so their gradients are averaged over the current
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

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed import ProcessGroup

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



class AveragedAcrossReplicas:
    """Sharded trainers in replica groups (``layout.trainer_replicas``): each FSDP unit of
    ``module`` (``fully_shard``'s or ``replicate``'s, over one replica group's grid) averages its
    reduced gradient shard across the live replica groups before FSDP hands it to the
    parameters: FSDP's all-reduce hook, where torchft's HSDP averages across replica groups.

    One all_reduce over TRAIN_DATA_PARALLEL (every live trainer) per unit: each rank fills the
    slot of its ``place`` in its ``replica`` group, so the ranks that hold the same shard sum
    it, and the slot is divided by the live replica groups. A loss during it fails the call on
    every trainer alike (rlcomm/elastic/commit.py), so each replica group's ranks recover
    together; the survivors average the same shard again over their next group
    (rlcomm.collectives). A unit averaged before the loss keeps the old group's average: every
    parameter's gradient is a whole average, over one set of replica groups."""

    def __init__(self, ctx: CommContext, module: nn.Module, place: int,
                 replica: ProcessGroup) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.ctx, self.place, self.replica = ctx, place, replica
        self.size = dist.get_world_size(replica)
        self.widths: dict[int, int] = {}  # per unit: the widest shard of its replica group
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.set_all_reduce_hook(self._hook(id(unit)))

    def _hook(self, unit: int) -> Callable[[torch.Tensor], None]:
        return lambda reduced: self._average(unit, reduced)

    def _average(self, unit: int, reduced: torch.Tensor) -> None:
        if unit not in self.widths:  # once, within the replica group (a rebuilt one too)
            sizes = torch.zeros(self.size, dtype=torch.int64)
            dist.all_gather_single(sizes, torch.tensor([reduced.numel()]),
                                        group=self.replica)
            self.widths[unit] = int(sizes.max())
        width, numel = self.widths[unit], reduced.numel()
        slots = torch.zeros(self.size, width, dtype=reduced.dtype)
        slots[self.place, :numel] = reduced.reshape(-1)
        collectives.all_reduce(self.ctx, TDP, slots)
        live_replicas = self.ctx.get_world_size(TDP) // self.size
        reduced.copy_(slots[self.place, :numel].view_as(reduced)).div_(live_replicas)
