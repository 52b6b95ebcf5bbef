"""The slices of a sharded trainer's weights (docs/sharding.md): which elements each shard
owner sends, where they land in the whole weights, and how a receiving rank assembles them.

Each trainer holds some elements of each parameter (a DTensor's local shard). An element is
sent by one trainer only: the one whose coordinate is 0 on every mesh dimension the parameter
is replicated over (the first replica of a ``replicate``d grid, the first tensor-parallel rank
of a replicated norm). Whatever is not a DTensor (the normalisers' statistics, buffers) is the
first trainer's to send. Where each slice goes in the whole tensor (flat element indices,
computed by DTensor itself) travels once. A large slice that is one block of the whole tensor
(FSDP2's dim-0 shards) is not copied on either side: it goes as a direct tensor from the
owner's local shard into its block of the receiving rank's whole weights (:func:`direct_of`);
the small ones are packed into one message per owner. The channel that sends them:
app/runtime/handoff/weights_sharded.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def shards_mode(owner: int) -> str:
    """The mode of the group in which trainer ``owner`` sends its slices."""
    return f"WEIGHT_SHARDS_{owner}"


# A slice at least this large travels on its own, from the owner's local shard straight into
# the rollout rank's whole weights (rlcomm.weights' ``direct`` tensors); a smaller one is packed
# with the others into one message, since a message of its own costs more than its copies.
DIRECT_MIN_BYTES = 1 << 20


class Slices(nn.Module):
    """The slices one owner sends, as buffers: what its receiver loads (and verifies). A direct
    one (see :func:`direct_of`) is the block of the whole weights it lands in, itself."""

    def __init__(self, like: dict[str, Tensor], direct: frozenset[str] = frozenset()) -> None:
        super().__init__()
        for name, tensor in like.items():
            key = _key(name)
            self.register_buffer(key, tensor if key in direct else torch.zeros_like(tensor))

    def slices(self) -> dict[str, Tensor]:
        """The slices by the name of the agent's entry they belong to."""
        return {name.replace("/", "."): tensor for name, tensor in self.named_buffers()}


def _key(name: str) -> str:
    return name.replace(".", "/")  # a buffer's name cannot hold a dot


class OwnedSlices:
    """What one trainer sends: for each entry of the agent's state dict it owns, its local
    elements (a view) and their flat indices in the whole tensor (None: the whole tensor)."""

    def __init__(self, agent: nn.Module, trained: nn.Module, first_trainer: bool) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        sharded = {f"net.{name}": param for name, param in trained.named_parameters()
                   if isinstance(param, DTensor)}
        self.entries: dict[str, tuple[Any, Tensor | None]] = {}
        for name, tensor in agent.state_dict().items():
            param = sharded.get(name)
            if param is None:
                if first_trainer:
                    self.entries[name] = (tensor, None)
                continue
            coordinate = list(param.device_mesh.get_coordinate() or [])
            if any(isinstance(p, Replicate) and coordinate[d] != 0
                   for d, p in enumerate(param.placements)):
                continue  # another replica's to send
            whole = DTensor.from_local(
                torch.arange(tensor.numel(), dtype=torch.float64).view(tensor.shape),
                param.device_mesh, [Replicate()] * param.device_mesh.ndim, run_check=False)
            indices = whole.redistribute(param.device_mesh, param.placements).to_local()
            self.entries[name] = (param, indices.reshape(-1).long())

    def values(self) -> dict[str, Tensor]:
        """This trainer's slices as they are now, flat."""
        return {_key(name): (_local(source).reshape(-1) if indices is not None else source)
                for name, (source, indices) in self.entries.items()}

    def indices(self) -> dict[str, Tensor | None]:
        return {name: indices for name, (_, indices) in self.entries.items()}


Placement = slice | Tensor  # where a slice goes in the flat whole tensor


def placements_of(indices: dict[str, Tensor | None]) -> dict[str, Placement]:
    """Each slice's flat indices as a block where they are one (copied, not scattered)."""
    placements: dict[str, Placement] = {}
    for name, index in indices.items():
        if index is None:
            placements[name] = slice(None)
        elif index.numel() == 0 or torch.equal(
                index, torch.arange(int(index[0]), int(index[0]) + index.numel())):
            start = int(index[0]) if index.numel() else 0
            placements[name] = slice(start, start + index.numel())
        else:
            placements[name] = index
    return placements


def direct_of(agent: nn.Module, indices: dict[str, Tensor | None]) -> frozenset[str]:
    """The slices (by their keys in :class:`Slices`) that travel on their own, straight from
    the owner's local shard into the whole weights: contiguous blocks (FSDP2 shards on dim 0)
    of at least ``DIRECT_MIN_BYTES``. Owner and rollout ranks compute the same set."""
    state = agent.state_dict()
    direct = set()
    for name, where in placements_of(indices).items():
        if isinstance(where, slice):
            numel = len(range(state[name].numel())[where])
            if numel * state[name].element_size() >= DIRECT_MIN_BYTES:
                direct.add(_key(name))
    return frozenset(direct)


def slices_for(agent: nn.Module, indices: dict[str, Tensor | None]) -> Slices:
    """Where one owner's slices land on a rollout rank (``indices``: as
    :meth:`OwnedSlices.indices` gives them): the direct ones are views of the agent's own
    tensors (received straight into them), the others buffers of their own."""
    state = agent.state_dict()
    placements = placements_of(indices)
    return Slices({name: state[name].reshape(-1)[placements[name]] if index is not None
                   else state[name] for name, index in indices.items()},
                  direct_of(agent, indices))


@torch.no_grad()
def assemble(agent: nn.Module, parts: list[tuple[Slices, dict[str, Placement]]]) -> None:
    """The whole weights, into ``agent``, from every owner's received slices."""
    state = agent.state_dict()
    for slices, placements in parts:
        for name, values in slices.slices().items():
            flat = state[name].view(-1)
            where = placements[name]
            if isinstance(where, slice):  # a contiguous block (FSDP's dim-0 shards)
                if values.data_ptr() != flat[where].data_ptr():  # else received in place
                    flat[where].copy_(values.reshape(-1))
            else:
                flat.index_copy_(0, where, values)


def _local(param: Any) -> Tensor:
    return param.to_local().detach()
