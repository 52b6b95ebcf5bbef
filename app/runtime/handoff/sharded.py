"""The hand-off of a static layout whose trainers are sharded (docs/sharding.md): each shard
owner sends its own slice of the weights, and every rollout rank assembles them whole.

Each trainer holds some elements of each parameter (a DTensor's local shard). An element is
sent by one trainer only: the one whose coordinate is 0 on every mesh dimension the parameter
is replicated over (the first replica of a ``replicate``d grid, the first tensor-parallel rank
of a replicated norm). Whatever is not a DTensor (the normalisers' statistics, buffers) is the
first trainer's to send. Each owner leads a group of its own with every rollout rank
(``WEIGHT_SHARDS_<rank>``, made like WEIGHT_TRANSFER's) and sends its slices with rlcomm.weights'
sender, so versions, checksums (``loop.verify_weights_every``) and ``loop.max_staleness`` work
as on the flat path; where each slice goes in the whole tensor (flat element indices, computed
by DTensor itself) travels once, when the groups form. A large slice that is one block of the
whole tensor (FSDP2's dim-0 shards) is not copied on either side: it goes as a direct tensor
from the owner's local shard into its block of the rollout rank's whole weights, in place in
lockstep (:func:`direct_of`); the small ones are packed into one message per owner. The
senders are steady (rlcomm.weights): an owner whose slices are all direct sends a version that
is not checksummed as those slices alone, without a header. Segments and episodes move as on
the flat path (:class:`~app.runtime.handoff.flat.FlatHandOff`). No trainer gathers the model to send it.
With elastic rollout ranks the same slices, index maps and assembly serve
app/runtime/handoff/elastic_sharded.py.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn
from torch import distributed as dist

from app.runtime.handoff.base import HandOffSettings
from app.runtime.handoff.flat import FlatHandOff, receive_weights
from app.runtime.segments import SegmentFormat
from rlcomm import CommContext, LayoutPlan, ParallelMode, collectives, register_initializer
from rlcomm.group_initializer import WeightTransferGroupInitializer
from rlcomm.weights import WeightReceiver, WeightSender

WT = ParallelMode.WEIGHT_TRANSFER


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


class ShardedHandOff(FlatHandOff):
    """A sharded grid's hand-off (see the module's doc); segments and episodes as the flat
    one's."""

    kind = "sharded"

    def __init__(self, ctx: CommContext, plan: LayoutPlan, agent: nn.Module, segment_format: SegmentFormat,
                 trained: Any, settings: HandOffSettings) -> None:
        # The flat hand-off's weights side is not made: nothing here is bound to the agent.
        super().__init__(ctx, plan, agent, segment_format, settings, weights=False)
        self.rollouts = list(plan.rollouts)
        first_trainer = min(plan.trainers)
        owned = (OwnedSlices(agent, trained.trained, self.rank == first_trainer)
                 if self.is_trainer else None)
        flags = collectives.all_gather(
            ctx, ParallelMode.GLOBAL, torch.tensor([[float(bool(owned and owned.entries))]]))
        self.owners = [r for r, flag in enumerate(flags.reshape(-1).tolist()) if flag]
        device = ctx.get_device(WT) if plan.group(WT) is not None else torch.device("cpu")
        for owner in self.owners:  # every rank makes every group, in the same order
            register_initializer(shards_mode(owner), WeightTransferGroupInitializer)
            ctx.init_group([owner, *plan.rollouts], mode=shards_mode(owner),
                           backend=ctx.backend, use_cpu=device.type == "cpu")
        self.owned: OwnedSlices | None = None
        self.shard_sender: WeightSender | None = None
        self.receivers: list[tuple[WeightReceiver, Slices, dict[str, Placement]]] = []
        self.sent_version = 0
        if owned is not None and self.rank in self.owners:
            self.owned = owned
            # Steady: the layout is static, so a version that is not checksummed and whose
            # slices are all direct (FSDP2's) goes without a header, one broadcast fewer.
            self.shard_sender = WeightSender(ctx, shards_mode(self.rank),
                                             verify_every=settings.verify_every,
                                             direct=direct_of(agent, owned.indices()),
                                             steady=True)
        for owner in self.owners:
            indices = self._share_indices(owner)
            if self.is_trainer:
                continue
            slices = slices_for(agent, indices)
            receiver = WeightReceiver(ctx, shards_mode(owner), expected=slices.state_dict(),
                                      direct=direct_of(agent, indices))
            # Loads point the slices at the received bytes, and the direct ones are received
            # straight into the agent's weights: no copy.
            receiver.bind(slices)
            self.receivers.append((receiver, slices, placements_of(indices)))
        if self.owned is not None:
            self.weight_bytes = sum(t.nbytes for t in self.owned.values().values())

    def _share_indices(self, owner: int) -> dict[str, Tensor | None]:
        """Where each of ``owner``'s slices goes, sent once over its group."""
        if self.rank != owner and self.rank not in self.rollouts:
            return {}
        payload = [self.owned.indices() if self.rank == owner and self.owned else None]
        dist.broadcast_object_list(payload, src=owner, group=self.ctx.get_group(shards_mode(owner)))
        return payload[0] or {}

    def version(self, updates: int) -> int:
        if self.is_trainer:
            return self.sent_version
        return self.acting_version

    def sync_weights(self, first: bool) -> bool:
        """Owners send their slices (the large ones from their local shards themselves: the
        optimizer steps only after :meth:`before_optimizer_step`); rollout ranks receive every
        owner's and assemble the whole weights (the large slices arrive in place)."""
        tick = time.perf_counter()
        if self.is_trainer:
            self.sent_version += 1
            if self.shard_sender is not None and self.owned is not None:
                self.shard_sender.send(self.owned.values(), wait=first)
                receivers = len(self.ctx.get_ranks_in_group(shards_mode(self.rank))) - 1
                self.weight_bytes_sent += receivers * self.weight_bytes
            self.transfer_s += time.perf_counter() - tick
            return True
        self.acting_version = receive_weights(
            [(receiver, slices) for receiver, slices, _ in self.receivers], first,
            self.max_staleness)
        self._assemble()
        self.wait_s += time.perf_counter() - tick
        return True

    def _assemble(self) -> None:
        assemble(self.agent, [(slices, placements) for _, slices, placements in self.receivers])

    def before_optimizer_step(self) -> None:
        if self.shard_sender is not None:
            tick = time.perf_counter()
            self.shard_sender.wait()
            self.transfer_s += time.perf_counter() - tick
