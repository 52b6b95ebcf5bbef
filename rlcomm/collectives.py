"""Collectives addressed by mode: ``all_reduce(ctx, ParallelMode.TRAIN_DATA_PARALLEL, t)``.

Every call is recorded in ``ctx.recorder`` (:mod:`rlcomm.diagnostics.recorder`): the hang watchdog's
evidence. The context is passed explicitly (no global), so one process could hold two contexts.
Rank arguments (``src``, ``dst``) are GLOBAL ranks, as in ``torch.distributed``; to address a
position inside the group use ``ctx.get_ranks_in_group(mode)[group_rank]`` (and
``.index(global_rank)`` for the way back). ``src``/``dst`` default to the group's leader: the first
rank the layout declared (e.g. the trainer of a WEIGHT_TRANSFER group).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from .context import CommContext
from .modes import Mode

ReduceOp = dist.ReduceOp


def leader(ctx: CommContext, mode: Mode) -> int:
    """Global rank of the group's first declared rank."""
    return ctx.get_declared_ranks(mode)[0]


def all_reduce(
    ctx: CommContext, mode: Mode, tensor: torch.Tensor, op: Any = ReduceOp.SUM
) -> torch.Tensor:
    """In-place all_reduce over this rank's ``mode`` group; returns ``tensor``."""
    group = ctx.get_group(mode)
    with ctx.recorder.call(mode, "all_reduce", tensor):
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_reduce_dict(
    ctx: CommContext, mode: Mode, values: Mapping[str, float | torch.Tensor], average: bool = False
) -> dict[str, float]:
    """Reduce scalar metrics in one collective, on the device the group's backend needs."""
    names = sorted(values)
    packed = torch.tensor(
        [float(values[name]) for name in names], dtype=torch.float64, device=ctx.get_device(mode)
    )
    all_reduce(ctx, mode, packed)
    if average:
        packed /= ctx.get_world_size(mode)
    return dict(zip(names, packed.tolist()))


def broadcast(
    ctx: CommContext, mode: Mode, tensor: torch.Tensor, src: int | None = None
) -> torch.Tensor:
    """Broadcast ``tensor`` in place from global rank ``src`` (default: the group leader)."""
    src = leader(ctx, mode) if src is None else src
    group = ctx.get_group(mode)
    with ctx.recorder.call(mode, "broadcast", tensor, src):
        dist.broadcast(tensor, src=src, group=group)
    return tensor


def broadcast_object_list(
    ctx: CommContext, mode: Mode, objects: list[Any], src: int | None = None
) -> list[Any]:
    """Pickle-based broadcast of Python objects, for trusted peers of one job only (the
    receiving side unpickles); keep it off hot paths and never for weights or trajectories."""
    src = leader(ctx, mode) if src is None else src
    group = ctx.get_group(mode)
    with ctx.recorder.call(mode, "broadcast_object_list", None, src):
        dist.broadcast_object_list(objects, src=src, group=group)
    return objects


def all_gather(ctx: CommContext, mode: Mode, tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every member's ``tensor`` along dim 0, in group-rank order."""
    size = ctx.get_world_size(mode)
    out = tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (size,))
    group = ctx.get_group(mode)
    with ctx.recorder.call(mode, "all_gather", tensor):
        dist.all_gather_single(out, tensor.contiguous(), group=group)
    return out


def gather(
    ctx: CommContext, mode: Mode, tensor: torch.Tensor, dst: int | None = None
) -> list[torch.Tensor] | None:
    """Collect every member's ``tensor`` on global rank ``dst`` (group-rank order); None elsewhere."""
    dst = leader(ctx, mode) if dst is None else dst
    is_dst = ctx.get_global_rank() == dst
    out = [torch.empty_like(tensor) for _ in range(ctx.get_world_size(mode))] if is_dst else None
    group = ctx.get_group(mode)
    with ctx.recorder.call(mode, "gather", tensor, dst):
        dist.gather(tensor, gather_list=out, dst=dst, group=group)
    return out


def scatter(
    ctx: CommContext,
    mode: Mode,
    out: torch.Tensor,
    chunks: list[torch.Tensor] | None = None,
    src: int | None = None,
) -> torch.Tensor:
    """Give member i (group-rank order) ``chunks[i]`` from global rank ``src``; fills ``out``."""
    src = leader(ctx, mode) if src is None else src
    group = ctx.get_group(mode)
    with ctx.recorder.call(mode, "scatter", out, src):
        dist.scatter(
            out, scatter_list=chunks if ctx.get_global_rank() == src else None, src=src, group=group
        )
    return out


def barrier(ctx: CommContext, mode: Mode) -> None:
    group = ctx.get_group(mode)
    with ctx.recorder.call(mode, "barrier"):
        dist.barrier(group=group)


def all_to_all(
    ctx: CommContext,
    mode: Mode,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    """all_to_all along dim 0 that gradients flow through (torch.distributed.nn's autograd op)."""
    rows = sum(output_split_sizes) if output_split_sizes is not None else tensor.shape[0]
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    group = ctx.get_group(mode)
    with ctx.recorder.call(mode, "all_to_all", tensor, same_shape=False):
        out = dist_fn.all_to_all_single(
            out, tensor, output_split_sizes, input_split_sizes, group=group
        )
    return out


def gather_json(ctx: CommContext, mode: Mode, obj: Any, dst: int | None = None) -> list[Any] | None:
    """Gather JSON-serialisable results on ``dst`` as bytes in tensors: data, never code."""
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    device = ctx.get_device(mode)
    lengths = all_gather(ctx, mode, torch.tensor([payload.numel()], device=device))
    padded = torch.zeros(int(lengths.max()), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    chunks = gather(ctx, mode, padded, dst)
    if chunks is None:
        return None
    return [
        json.loads(bytes(chunk[: int(n)].cpu().numpy().tobytes()).decode())
        for chunk, n in zip(chunks, lengths.tolist())
    ]
