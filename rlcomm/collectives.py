"""Collectives addressed by mode: ``all_reduce(ctx, ParallelMode.TRAIN_DATA_PARALLEL, t)``.

Every call is recorded in ``ctx.recorder`` (:mod:`rlcomm.diagnostics.recorder`): the hang watchdog's
evidence. The context is passed explicitly (no global), so one process could hold two contexts.
Rank arguments (``src``, ``dst``) are GLOBAL ranks, as in ``torch.distributed``; to address a
position inside the group use ``ctx.get_ranks_in_group(mode)[group_rank]`` (and
``.index(global_rank)`` for the way back). ``src``/``dst`` default to the group's leader: the first
rank the layout declared (e.g. the trainer of a WEIGHT_TRANSFER group).

A membership epoch's group (rlcomm.elastic, ``CommContext.epochs``) is a gloo
backend outside torch's world maps: its calls go to the backend itself, by group rank. Where the
context recovers a mode's group (``CommContext.recovery``, rlcomm/recovery.py), a call whose group failed
waits for the next group and runs again on it, from the same input.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from .context import CommContext
from .elastic import graveyard
from .errors import GroupBrokenError
from .modes import Mode, mode_name

ReduceOp = dist.ReduceOp


def leader(ctx: CommContext, mode: Mode) -> int:
    """Global rank of the group's first declared rank."""
    return ctx.get_declared_ranks(mode)[0]


def _run(ctx: CommContext, mode: Mode, call: Callable[[Any], None],
         keep: torch.Tensor | None = None) -> None:
    """``call(group)`` on this rank's group of ``mode``; where the context recovers that mode,
    a failed call runs again on the next group, ``keep`` (what it writes in place) restored."""
    recover = ctx.recovery.recovers(mode)
    kept = keep.clone() if keep is not None and recover else None
    while True:
        try:
            call(ctx.get_group(mode))
            ctx.recovery.commit(mode)  # where one is set: completed on every member, or failed
            return
        except RuntimeError as err:
            if not recover or not ctx.recovery.recover(mode, err):
                raise
            if kept is not None and keep is not None:
                keep.copy_(kept)


POLL_S = 0.2  # how often a call waiting on an epoch group that can be declared broken looks


def _await(ctx: CommContext, mode: Mode, work: Any) -> None:
    """Waits for ``work`` on an epoch group; gives up (GroupBrokenError) once a member declared
    the group broken (``CommContext.recovery``)."""
    broken = ctx.recovery.broken(mode)
    if broken is None:
        work.wait()
        return
    while True:
        try:
            work.wait(datetime.timedelta(seconds=POLL_S))
            return
        except RuntimeError as err:
            if "Operation timed out!" not in str(err):  # gloo's own error, not the poll's
                raise
            if broken():
                graveyard.append(work)  # gloo cannot abort it: it lives as the process does
                raise GroupBrokenError(f"{mode_name(mode)}: a member declared the group "
                                       "broken") from None


def _position(ctx: CommContext, mode: Mode, rank: int) -> int:
    return ctx.get_ranks_in_group(mode).index(rank)


def all_reduce(
    ctx: CommContext, mode: Mode, tensor: torch.Tensor, op: Any = ReduceOp.SUM
) -> torch.Tensor:
    """In-place all_reduce over this rank's ``mode`` group; returns ``tensor``."""

    def call(group: Any) -> None:
        with ctx.recorder.call(mode, "all_reduce", tensor):
            if ctx.epochs.holds(mode):
                options = dist.AllreduceOptions()
                options.reduceOp = op
                _await(ctx, mode, group.allreduce([tensor], options))
            else:
                dist.all_reduce(tensor, op=op, group=group)

    _run(ctx, mode, call, keep=tensor)
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

    def call(group: Any) -> None:
        with ctx.recorder.call(mode, "broadcast", tensor, src):
            if ctx.epochs.holds(mode):
                options = dist.BroadcastOptions()
                options.rootRank = _position(ctx, mode, src)
                _await(ctx, mode, group.broadcast([tensor], options))
            else:
                dist.broadcast(tensor, src=src, group=group)

    _run(ctx, mode, call, keep=tensor)
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
    gathered: list[torch.Tensor] = []

    def call(group: Any) -> None:
        size = ctx.get_world_size(mode)  # the group's now: a recovered one may be smaller
        shape = (size * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (size,)
        out = tensor.new_empty(shape)
        with ctx.recorder.call(mode, "all_gather", tensor):
            if ctx.epochs.holds(mode):
                _await(ctx, mode, group.allgather([list(out.chunk(size))], [tensor.contiguous()]))
            else:
                dist.all_gather_single(out, tensor.contiguous(), group=group)
        gathered[:] = [out]

    _run(ctx, mode, call)
    return gathered[0]


def gather(
    ctx: CommContext, mode: Mode, tensor: torch.Tensor, dst: int | None = None
) -> list[torch.Tensor] | None:
    """Collect every member's ``tensor`` on global rank ``dst`` (group-rank order); None elsewhere."""
    dst = leader(ctx, mode) if dst is None else dst
    is_dst = ctx.get_global_rank() == dst
    gathered: list[list[torch.Tensor] | None] = [None]

    def call(group: Any) -> None:
        size = ctx.get_world_size(mode)
        out = [torch.empty_like(tensor) for _ in range(size)] if is_dst else None
        with ctx.recorder.call(mode, "gather", tensor, dst):
            if ctx.epochs.holds(mode):
                options = dist.GatherOptions()
                options.rootRank = _position(ctx, mode, dst)
                _await(ctx, mode, group.gather([out] if out is not None else [], [tensor], options))
            else:
                dist.gather(tensor, gather_list=out, dst=dst, group=group)
        gathered[0] = out

    _run(ctx, mode, call)
    return gathered[0]


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
    def call(group: Any) -> None:
        with ctx.recorder.call(mode, "barrier"):
            if ctx.epochs.holds(mode):
                _await(ctx, mode, group.barrier(dist.BarrierOptions()))
            else:
                dist.barrier(group=group)

    _run(ctx, mode, call)


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
