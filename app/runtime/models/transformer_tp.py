"""The transformer policy's tensor-parallel plan (app/runtime/models/transformer.py): torchtitan's
Llama plan over TENSOR_PARALLEL, with sequence parallelism for its norms, and the style that keeps
every other part replicated. Imported only where a grid splits the model: torch's DTensor styles
take most of a second to import, which every launch and rank would otherwise pay."""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)


class SplitTransformer(Protocol):
    """What the plan reads of the policy (app/runtime/models/transformer.py's
    TransformerActorCritic): its blocks, the window's dimension and the action kind."""

    layers: nn.ModuleList
    discrete: bool

    @property
    def seq_dim(self) -> int: ...


class ReplicateParallel(ParallelStyle):
    """A module's parameters replicated over the tensor-parallel mesh, with plain tensors in and
    out: the style of a plan's small parts (embeddings, norms, heads) beside the split
    projections. Every parameter of a tensor-parallel model is then a DTensor on one mesh, which
    ``fully_shard``, ``replicate`` and ``clip_grad_norm_`` need."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(module, device_mesh, input_fn=_replicated_inputs,
                                 output_fn=_local_outputs)


def _replicated_inputs(module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                 if isinstance(x, Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _local_outputs(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    from torch.distributed.tensor import DTensor

    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def tensor_parallel_plan(model: SplitTransformer, sequence_parallel: bool = False,
                         replicate_rest: bool = False) -> dict[str, ParallelStyle]:
    """torchtitan's Llama plan for ``model``, for ``parallelize_module(model, tp_mesh, plan)``.

    Per block, ``wq``/``wk``/``wv`` and ``w1``/``w3`` are column-sharded (each rank keeps whole
    heads) and ``wo``/``w2`` row-sharded, so a block costs one all-reduce per sublayer. With
    ``sequence_parallel`` the blocks' norms run on window shards (``SequenceParallel``), each
    sublayer gathers the window first and reduce-scatters it after, and the residual stream
    between blocks stays sharded: it is split on entering the first block and gathered on
    leaving the last, since the embedding before and the heads after are replicated.
    ``replicate_rest``: the parts outside the split projections get a :class:`ReplicateParallel`
    entry too, so every parameter is a DTensor on the mesh (what ``fully_shard`` over a second
    mesh dimension and torch's ``clip_grad_norm_`` need).
    """
    seq_dim = model.seq_dim
    seq = Shard(seq_dim)
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.layers)):
        block = f"layers.{i}"
        # The sublayers' outputs: whole (all-reduce), or window shards (reduce-scatter).
        out = seq if sequence_parallel else Replicate()
        plan.update({
            f"{block}.attention.wq": ColwiseParallel(),
            f"{block}.attention.wk": ColwiseParallel(),
            f"{block}.attention.wv": ColwiseParallel(),
            f"{block}.attention.wo": RowwiseParallel(output_layouts=out),
            f"{block}.feed_forward.w1": ColwiseParallel(),
            f"{block}.feed_forward.w3": ColwiseParallel(),
            f"{block}.feed_forward.w2": RowwiseParallel(output_layouts=out),
        })
        if sequence_parallel:
            plan.update({
                f"{block}.attention_norm": SequenceParallel(sequence_dim=seq_dim),
                # (x, keep): the mask is whole on every rank already.
                f"{block}.attention": PrepareModuleInput(
                    input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
                f"{block}.ffn_norm": SequenceParallel(sequence_dim=seq_dim),
                f"{block}.feed_forward": PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            })
    if sequence_parallel:
        first, last = "layers.0", f"layers.{len(model.layers) - 1}"
        whole, split = (Replicate(), None), (seq, None)  # (x, keep) in; x out
        if first == last:
            plan[first] = PrepareModuleInputOutput(
                input_layouts=whole, desired_input_layouts=split, use_local_input=True,
                output_layouts=seq, desired_output_layouts=Replicate(), use_local_output=True)
        else:
            plan[first] = PrepareModuleInput(
                input_layouts=whole, desired_input_layouts=split, use_local_output=True)
            plan[last] = PrepareModuleOutput(
                output_layouts=seq, desired_output_layouts=Replicate(), use_local_output=True)
    if replicate_rest:
        rest = ["embed", "pos", "norm", "critic", "actor"]
        rest += [] if model.discrete else ["actor_std"]
        if not sequence_parallel:
            rest += [f"layers.{i}.{norm}" for i in range(len(model.layers))
                     for norm in ("attention_norm", "ffn_norm")]
        plan.update({name: ReplicateParallel() for name in rest})
    return plan
