"""Sharded trainers: the plan's trainer grid applied to the module a trainer trains.

The layout lays DATA x SEQUENCE x TENSOR parallel groups over the trainer ranks (rlcomm.plan). A
trainer's module is trained in one of these ways, picked by the grid and ``loop.data_parallel``
as the run's shape holds them (``RunShape.sharded``, ``RunShape.data_parallel``: app.api):

- ``ddp`` without tensor parallelism: ``DistributedDataParallel`` over the trainers, on the
  acting module itself (what an unsharded grid of trainers trains, number for number); a lone
  trainer trains that module bare;
- ``ddp`` with tensor parallelism: the module's tensor-parallel plan over TENSOR_PARALLEL, then
  torch's composable ``replicate`` over DATA_PARALLEL;
- ``fsdp``: the tensor-parallel plan if any, then ``fully_shard`` over DATA_PARALLEL (each block
  first, then the root: torchtitan's order).

With sequence parallelism the module splits its window over SEQUENCE_PARALLEL (context parallelism,
:meth:`app.runtime.models.transformer.TransformerActorCritic.context_parallel`) and data parallelism
spans data x sequence (torchtitan's ``dp_shard_cp``), since the sequence ranks hold the same
parameters and each computes the replica's whole loss.

The ranks of one TENSOR x SEQUENCE block hold one data-parallel replica: they train on the same
batch (their segments, shared between them, :func:`share_replica_segments`) with the same
minibatch order (seeded from :func:`replica_rank`). A sharded module is a copy of the acting module; after each update the trainer writes its
full weights back into the acting module (:meth:`TrainedModule.publish`), which is what acts and
what the hand-off sends.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from app.api import RunShape
from app.runtime.core.algorithm import Segment
from app.runtime.trainer.gradients import AveragedAcrossReplicas
from rlcomm import CommContext, LayoutPlan, ParallelMode, collectives

DATA_PARALLEL_KINDS = ("ddp", "fsdp")
DP, SP, TP, TDP = (ParallelMode.DATA_PARALLEL, ParallelMode.SEQUENCE_PARALLEL,
                   ParallelMode.TENSOR_PARALLEL, ParallelMode.TRAIN_DATA_PARALLEL)
# The mesh dimension of data x sequence when tensor parallelism splits the trainers too.
DATA_SEQUENCE = "DATA_SEQUENCE_PARALLEL"


@dataclass(frozen=True)
class TrainerGrid:
    """The trainer grid's sizes: ``data`` replicas of ``tensor`` x ``sequence`` ranks each."""

    data: int
    sequence: int
    tensor: int

    @classmethod
    def of(cls, plan: LayoutPlan) -> TrainerGrid:
        return cls(*plan.grid_sizes)

    @property
    def replica_size(self) -> int:
        """Trainer ranks that hold one data-parallel replica (and train on the same batch)."""
        return self.tensor * self.sequence


def has_tensor_parallel_plan(module: nn.Module) -> bool:
    """Whether ``module`` says how to split it over TENSOR_PARALLEL: a method
    ``tensor_parallel_plan() -> dict[str, ParallelStyle]`` for ``parallelize_module``."""
    return callable(getattr(module, "tensor_parallel_plan", None))


class TrainedModule:
    """What a trainer trains: ``model`` (what an update's losses go through) and the parameters
    its optimizer steps (``parameters()``), over the acting module ``net``, as the run's
    ``shape`` says (sharded or not, how, elastic trainers or not)."""

    def __init__(self, ctx: CommContext, plan: LayoutPlan, net: nn.Module,
                 shape: RunShape) -> None:
        if shape.data_parallel not in DATA_PARALLEL_KINDS:
            raise ValueError(f"data_parallel: must be one of {DATA_PARALLEL_KINDS}, got "
                             f"{shape.data_parallel!r}")
        self.net, self.shape = net, shape
        self.grid = TrainerGrid.of(plan)
        self.sharded = shape.sharded
        self.model: nn.Module
        # Sharded replica groups (layout.trainer_replicas): this rank's replica group, over
        # which its checkpoints are written and read (:meth:`checkpoint_group`).
        self.replica_group: ProcessGroup | None = None
        self.writes_checkpoints = True
        if not self.sharded:
            self.trained: nn.Module = net
            # DDP's group: the trainers (the same ranks as a planned DATA_PARALLEL grid). Elastic
            # trainers re-form theirs: their gradients are averaged over the live trainers by
            # app/runtime/trainer/gradients.py instead, on the acting module itself. A lone
            # trainer has nothing to average: DDP over a group of one would still copy every
            # gradient into its buckets and all-reduce them with itself: up to a third of a
            # small learner step on one thread (docs/off-policy.md, "Learner speed").
            alone = len(plan.trainers) == 1
            self.model = net if shape.elastic_trainers or alone else DistributedDataParallel(
                net, process_group=ctx.get_group(TDP))
            return
        self.trained = copy.deepcopy(net)
        data_mesh, tensor_mesh = _meshes(ctx, plan, self.grid, shape.replica_groups)
        if self.grid.sequence > 1:
            self.trained.context_parallel(ctx.get_group(SP))  # type: ignore[operator]
        if tensor_mesh is not None:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(self.trained, tensor_mesh,
                               self.trained.tensor_parallel_plan())  # type: ignore[operator]
        # Before FSDP's own hook (``replicate`` is built on it), which warns of outputs that
        # are views (an in-place op on one would skip its backward all-gather): the policy's
        # are (``squeeze``).
        self.trained.register_forward_hook(_outputs_not_views)
        if shape.data_parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in _blocks(self.trained):
                fully_shard(block, mesh=data_mesh)
            fully_shard(self.trained, mesh=data_mesh)
        else:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(self.trained, mesh=data_mesh)
        if shape.elastic_trainers:  # replica groups (layout.trainer_replicas): the grid above is one
            import torch.distributed as dist

            replica = plan.replica_of(ctx.get_global_rank())
            self.replica_group = dist.new_group(ctx.world_ranks(replica),
                                                use_local_synchronization=True)
            AveragedAcrossReplicas(ctx, self.trained, replica.index(ctx.get_global_rank()),
                                   self.replica_group)
            # Every replica group holds the whole state: the lead's writes it.
            self.writes_checkpoints = min(plan.trainers) in replica
        self.model = self.trained

    def checkpoint_group(self, ctx: CommContext) -> ProcessGroup:
        """The trainers that write and read a sharded checkpoint together: the trainers, or
        with replica groups this rank's (TRAIN_DATA_PARALLEL's epoch groups are not torch's
        registered groups, which torch.distributed.checkpoint needs)."""
        return self.replica_group or ctx.get_group(TDP)

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps: the acting module's own (DDP) or the sharded copy's."""
        return list(self.trained.parameters())

    @torch.no_grad()
    def publish(self) -> None:
        """The trained weights, whole, into the acting module (every trainer of the grid takes
        part: a sharded parameter is gathered). A no-op under plain DDP, which trains ``net``."""
        if not self.sharded:
            return
        targets = dict(self.net.named_parameters())
        for name, param in self.trained.named_parameters():
            targets[name].copy_(_full(param))

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The policy's and the optimizer's state, whole (every trainer takes part), as a
        checkpoint keeps them: a sharded trainer's optimizer state is keyed by parameter name."""
        if not self.sharded:
            return self.net.state_dict(), optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        return self.net.state_dict(), get_optimizer_state_dict(self.trained, optimizer,
                                                               options=options)

    def sharded_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"policy": ..., "optimizer": ...}`` as ``torch.distributed.checkpoint`` saves and
        loads them: this trainer's own shards (DTensors; whole tensors under DDP), optimizer
        state keyed by parameter name. Nothing is gathered. An optimizer that has not stepped
        yet gets its state made (torch steps it once with zero gradients and lr 0), so that a
        resume has tensors to load into."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        policy, optimizer_state = get_state_dict(self.trained, optimizer)
        return {"policy": policy, "optimizer": optimizer_state}

    def load_sharded_state(self, state: Mapping[str, Any],
                           optimizer: torch.optim.Optimizer) -> None:
        """``state`` (as :meth:`sharded_state` made it, then filled) into the trained module
        and the optimizer, then the whole weights into the acting module (every trainer of
        the grid takes part)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.trained, optimizer, model_state_dict=state["policy"],
                       optim_state_dict=state["optimizer"])
        self.publish()

    def load(self, policy: Mapping[str, Tensor], optimizer_state: dict[str, Any],
             optimizer: torch.optim.Optimizer) -> None:
        """A checkpoint's whole state into the acting module, the trained one and the
        optimizer, whichever grid wrote it (optimizer state keyed by parameter index, as DDP's
        optimizer writes it, or by name, as a sharded trainer's does)."""
        self.net.load_state_dict(policy)
        names = [name for name, _ in self.net.named_parameters()]
        if not self.sharded and not _keyed_by_name(optimizer_state):
            optimizer.load_state_dict(optimizer_state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        if self.sharded:
            set_model_state_dict(self.trained, dict(policy), options=options)
        by_name = optimizer_state if _keyed_by_name(optimizer_state) else \
            _by_name(optimizer_state, names)
        set_optimizer_state_dict(self.trained, optimizer, by_name, options=options)


def _meshes(ctx: CommContext, plan: LayoutPlan, grid: TrainerGrid,
            replica_groups: bool) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The mesh gradients are reduced over (the data replicas, times the SEQUENCE_PARALLEL ranks
    of each) and the TENSOR_PARALLEL mesh (None without tensor parallelism)."""
    whole = not replica_groups
    if plan.group(DP) is None or (grid.sequence > 1 and grid.tensor == 1 and whole):
        return ctx.device_mesh([TDP]), None  # data x sequence is every trainer
    if grid.sequence == 1:
        mesh = ctx.device_mesh([DP, TP])
        return mesh[DP.value], (mesh[TP.value] if grid.tensor > 1 else None)
    import torch.distributed as dist

    # No mode plans data x sequence within a replica group, nor under tensor parallelism: the
    # ranks at one TENSOR_PARALLEL coordinate of this rank's replica group make it, locally (a
    # group every rank of the world made, as DeviceMesh._flatten makes it, would need the
    # rollout ranks too).
    trainers = sorted(plan.replica_of(ctx.get_global_rank()))
    column = trainers[trainers.index(ctx.get_global_rank()) % grid.tensor :: grid.tensor]
    group = dist.new_group(ctx.world_ranks(column), use_local_synchronization=True)
    device = ctx.get_device(TP).type
    if grid.tensor == 1:
        return DeviceMesh.from_group(group, device, mesh=torch.tensor(ctx.world_ranks(column)),
                                     mesh_dim_names=(DATA_SEQUENCE,)), None
    mesh = DeviceMesh.from_group(
        [group, ctx.get_group(TP)], device,
        mesh=torch.tensor(ctx.world_ranks(trainers)).reshape(-1, grid.tensor),
        mesh_dim_names=(DATA_SEQUENCE, TP.value))
    return mesh[DATA_SEQUENCE], mesh[TP.value]


def _outputs_not_views(module: nn.Module, inputs: Any, outputs: Any) -> Any:
    if isinstance(outputs, tuple):
        return tuple(o.clone() if isinstance(o, Tensor) and o._base is not None else o
                     for o in outputs)
    return outputs.clone() if isinstance(outputs, Tensor) and outputs._base is not None else outputs


def _full(param: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The units FSDP shards one at a time before the root: a module's ``layers`` (a
    transformer's blocks), if it has them."""
    layers = getattr(module, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _keyed_by_name(optimizer_state: Mapping[str, Any]) -> bool:
    return any(isinstance(key, str) for key in optimizer_state.get("state", {}))


def _by_name(optimizer_state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter index (``Optimizer.state_dict``) keyed by the
    parameters' names instead, as torch's distributed state-dict API takes it."""
    state = {names[index]: value for index, value in optimizer_state["state"].items()}
    groups = [{**group, "params": [names[i] for i in group["params"]]}
              for group in optimizer_state["param_groups"]]
    return {"state": state, "param_groups": groups}


def share_segments(ctx: CommContext, segments: list[Segment], mode: ParallelMode = TP,
                   template: Segment | None = None) -> list[Segment]:
    """Every segment of this rank's ``mode`` group, in group-rank order (TENSOR_PARALLEL: the
    batch of the data-parallel replica the group holds, the same on each of its ranks).
    ``template``: a segment of the same format, for a rank that has none."""
    template = segments[0] if segments else template
    if template is None:
        raise ValueError("share_segments: a rank without segments needs a template")
    counts = collectives.all_gather(ctx, mode, torch.tensor([len(segments)]))
    most = int(counts.max())
    parts = _parts(template)
    shared: list[list[Segment]] = [[] for _ in range(len(counts))]
    for index in range(most):
        mine = segments[index] if index < len(segments) else template
        gathered = collectives.all_gather(ctx, mode, _flatten(_parts(mine)).unsqueeze(0))
        for member, row in enumerate(gathered):
            if index < int(counts[member]):
                shared[member].append(_segment(_unflatten(row, parts)))
    return [segment for member in shared for segment in member]


def share_replica_segments(ctx: CommContext, grid: TrainerGrid,
                           segments: list[Segment]) -> list[Segment]:
    """Every segment of this rank's data-parallel replica (its TENSOR x SEQUENCE block), the same
    list on each of its ranks: shared over TENSOR_PARALLEL, then those lists over
    SEQUENCE_PARALLEL."""
    if grid.tensor > 1:
        segments = share_segments(ctx, segments, TP)
    if grid.sequence > 1:
        segments = share_segments(ctx, segments, SP)
    return segments


def replica_rank(plan: LayoutPlan, rank: int) -> int:
    """The first trainer of ``rank``'s data-parallel replica (its TENSOR x SEQUENCE block), whose
    seed its ranks share; ``rank`` itself outside a planned grid."""
    groups = plan.groups_of(rank)
    if TP.value not in groups:
        return rank
    head = min(groups[TP.value])  # the block's row of ``rank``, then that row's column
    return min(plan.groups_of(head).get(SP.value, (head,)))


def _parts(segment: Segment) -> dict[str, Tensor]:
    """A segment's tensors, with its version, lag and moments, under one flat naming."""
    return {
        **{f"field/{k}": v for k, v in segment.items()},
        **{f"moments/{k}": v for k, v in segment.moments.items()},
        "meta/version_lag": torch.tensor([segment.version, segment.lag]),
    }


def _flatten(parts: Mapping[str, Tensor]) -> Tensor:
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in parts.values()])


def _unflatten(flat: Tensor, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out, offset = {}, 0
    for name, tensor in like.items():
        nbytes = tensor.numel() * tensor.element_size()
        out[name] = flat[offset : offset + nbytes].view(tensor.dtype).reshape(tensor.shape)
        offset += nbytes
    return out


def _segment(parts: Mapping[str, Tensor]) -> Segment:
    segment = Segment({k.split("/", 1)[1]: v for k, v in parts.items() if k.startswith("field/")})
    segment.moments = {k.split("/", 1)[1]: v for k, v in parts.items()
                       if k.startswith("moments/")}
    segment.version, segment.lag = (int(x) for x in parts["meta/version_lag"].tolist())
    return segment

