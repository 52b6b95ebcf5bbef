"""``debug`` mode: before each collective, its group agrees on what it is about to run.

An all_gather of a small fixed-size int64 descriptor (op, dtype, peer, shape) in the same group,
so a mismatch fails at once, on every member, with both sides named, instead of hanging until
the timeout or corrupting data. It doubles the number of collectives: a tool for finding a bug.
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from rlcomm.diagnostics.recorder import format_call
from rlcomm.errors import CollectiveMismatchError
from rlcomm.group_initializer import group_description
from rlcomm.modes import Mode

if TYPE_CHECKING:
    from rlcomm.diagnostics.recorder import Call


class Groups(Protocol):
    """What the check reads of the registry (rlcomm.context.CommContext, which calls it)."""

    @property
    def store(self) -> dist.Store: ...
    def get_group(self, comm_mode: Mode) -> dist.ProcessGroup: ...
    def get_device(self, comm_mode: Mode) -> torch.device: ...
    def get_world_size(self, comm_mode: Mode) -> int: ...
    def get_ranks_in_group(self, comm_mode: Mode) -> list[int]: ...
    def get_declared_ranks(self, comm_mode: Mode) -> list[int]: ...
    def get_global_rank(self) -> int: ...

_OPS = (
    "all_reduce", "broadcast", "broadcast_object_list", "all_gather", "gather", "scatter",
    "barrier", "all_to_all",
)
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)
_MAX_DIMS = 6
_WIDTH = 4 + _MAX_DIMS  # op, dtype, peer, ndim, dims (a longer shape adds its numel last)
_SITE_WAIT_S = 5.0  # how long to wait for the other side's file:line


def _describe(call: Call, tensor: torch.Tensor | None, same_shape: bool) -> list[int]:
    row = [_OPS.index(call.op) if call.op in _OPS else len(_OPS), -1, -1, -1] + [0] * _MAX_DIMS
    if call.peer is not None:
        row[2] = call.peer
    if tensor is not None:
        row[1] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
        if same_shape:
            shape = list(tensor.shape)
            row[3] = len(shape)
            dims = shape if len(shape) <= _MAX_DIMS else [*shape[: _MAX_DIMS - 1], tensor.numel()]
            row[4 : 4 + len(dims)] = dims
    return row


def agree_on_call(
    ctx: Groups, call: Call, tensor: torch.Tensor | None, same_shape: bool
) -> None:
    """Fail on every member of ``call``'s group unless all are about to run the same call."""
    group = ctx.get_group(call.mode)
    device = ctx.get_device(call.mode)
    mine = torch.tensor(_describe(call, tensor, same_shape), dtype=torch.int64, device=device)
    size = ctx.get_world_size(call.mode)
    rows = torch.empty(size * _WIDTH, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(rows, mine, group=group)
    table = rows.view(size, _WIDTH).tolist()
    signatures = [tuple(row) for row in table]
    if len(set(signatures)) == 1:
        return
    ranks = ctx.get_ranks_in_group(call.mode)  # group-rank order of the rows
    first = next(i for i, s in enumerate(signatures) if s != signatures[0])
    sides = _sites(ctx, call, [ranks[0], ranks[first]])
    raise CollectiveMismatchError(
        f"collective mismatch in "
        f"{group_description(call.mode, ctx.get_declared_ranks(call.mode))} #{call.seq}: "
        f"rank {ranks[0]} calls {sides[0]} but rank {ranks[first]} calls {sides[1]} "
        "(comm.debug)"
    )


def _sites(ctx: Groups, call: Call, pair: list[int]) -> list[str]:
    """Both sides' calls with their file:line, exchanged over the store (on mismatch only)."""
    store = ctx.store
    key = f"debug/{call.mode}/{call.seq}/"
    record = call.record()
    store.set(key + str(ctx.get_global_rank()), json.dumps(record))
    out = []
    for rank in pair:
        try:
            store.wait([key + str(rank)], datetime.timedelta(seconds=_SITE_WAIT_S))
            out.append(format_call(json.loads(store.get(key + str(rank))), with_seq=False))
        except Exception:  # that rank is gone or slow: say what is known
            out.append(f"something else (rank {rank} did not say what)")
    return out
