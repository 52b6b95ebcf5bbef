"""The sharded weight channel (docs/sharding.md): each shard owner sends its own slices
(app/runtime/handoff/slices.py) to every acting rank, which assembles the whole weights. No
trainer gathers the model to send it.

Each owner leads a group of its own with every acting rank (``WEIGHT_SHARDS_<owner>``) and sends
with rlcomm.weights' sender, so versions, checksums and ``max_staleness`` work as on the flat
channel. The large slices go direct, from the owner's local shard into the acting rank's whole
weights, in place in lockstep.

Static layout: the groups are made once (like WEIGHT_TRANSFER's), where each slice goes is
broadcast on them once, and the senders are steady (a version that is not checksummed and whose
slices are all direct, FSDP2's, goes without a header). Elastic layout (the channel is given the epoch groups' ``patience``): every
leader's members take every owner's slices, so a membership change is the job's (:meth:`agree`:
one all-reduce over TRAIN_DATA_PARALLEL); at each change the job's live members (every leader's)
form the next *generation* of shard groups (``elastic/shards/gen/<g>``, written by the first
trainer; each leader's epoch record names its generation, ``elastic/<leader>/gen/<epoch>``), on
which each owner sends its first slices verified. Where each owner's slices go travels in the
store (``elastic/shards/indices/<owner>``), so a joiner reads it there. A send to a lost member
fails alone (:meth:`WeightSender.settle`); its leader drops it, and the next boundary forms the
next generation without it.
"""

from __future__ import annotations

import base64
import datetime
import io
import json
import logging
from typing import Any

import torch
from torch import Tensor, nn
from torch import distributed as dist

from app.runtime.handoff.base import HandOffSettings, HandOffStats
from app.runtime.handoff.slices import (
    OwnedSlices,
    Placement,
    Slices,
    assemble,
    direct_of,
    placements_of,
    shards_mode,
    slices_for,
)
from app.runtime.handoff.weights import receive_weights
from rlcomm import CommContext, LayoutPlan, ParallelMode, collectives, register_initializer
from rlcomm.elastic import ShardKeys, build_epoch_group, graveyard
from rlcomm.group_initializer import WeightTransferGroupInitializer
from rlcomm.net.gloo_words import describe_loss
from rlcomm.weights import WeightReceiver, WeightSender

TDP, GLOBAL = ParallelMode.TRAIN_DATA_PARALLEL, ParallelMode.GLOBAL
log = logging.getLogger(__name__)
SPACE = "shards/"  # the shard groups' series of epochs beside an owner's own (rlcomm.elastic)
KEYS = ShardKeys()
Indices = dict[str, Tensor | None]


def generation_of(leader: int, epoch: int) -> str:
    """The store key naming the shard generation a leader's epoch belongs to."""
    return KEYS.leader_generation(leader, epoch)


def shard_group(ctx: CommContext, owner: int, generation: int, members: list[int],
                timeout: datetime.timedelta) -> list[int]:
    """Builds and registers this rank's group of ``owner``'s slices for ``generation``
    (``members``: the job's live acting ranks); returns its ranks, owner first."""
    ranks = [owner, *members]
    group = build_epoch_group(ctx.store, owner, generation, ranks, ctx.get_global_rank(),
                              timeout, space=SPACE)
    ctx.epochs.register(ctx, shards_mode(owner), group, ranks)
    return ranks


def static_owners(ctx: CommContext, plan: LayoutPlan, owned: OwnedSlices | None) -> list[int]:
    """Every rank of a static layout learns who owns slices and makes every owner's group
    (owner and every rollout rank), in the same order."""
    flags = collectives.all_gather(ctx, GLOBAL, torch.tensor([[float(bool(owned and owned.entries))]]))
    owners = [r for r, flag in enumerate(flags.reshape(-1).tolist()) if flag]
    device = ctx.get_device(ParallelMode.WEIGHT_TRANSFER) \
        if plan.group(ParallelMode.WEIGHT_TRANSFER) is not None else torch.device("cpu")
    for owner in owners:
        register_initializer(shards_mode(owner), WeightTransferGroupInitializer)
        ctx.init_group([owner, *plan.rollouts], mode=shards_mode(owner),
                       backend=ctx.backend, use_cpu=device.type == "cpu")
    return owners


def share_indices(ctx: CommContext, owner: int, owned: OwnedSlices | None) -> Indices:
    """Where each of ``owner``'s slices goes, broadcast once over its static group."""
    payload = [owned.indices() if ctx.get_global_rank() == owner and owned else None]
    dist.broadcast_object_list(payload, src=owner, group=ctx.get_group(shards_mode(owner)))
    return payload[0] or {}


class ShardSender:
    """A trainer's end: its own slices, if it owns any, to every acting rank."""

    sends = True

    def __init__(self, ctx: CommContext, plan: LayoutPlan, agent: nn.Module, trained: Any,
                 settings: HandOffSettings, stats: HandOffStats,
                 patience: datetime.timedelta | None) -> None:
        """``patience``: the epoch groups' timeout, on an elastic layout (None: static)."""
        self.ctx, self.agent, self.stats = ctx, agent, stats
        self.patience, self.elastic = patience, patience is not None
        self.rank = ctx.get_global_rank()
        self.verify_every = settings.verify_every
        self.version = 0
        self.generation = -1
        self.sender: WeightSender | None = None
        trainers = ctx.get_ranks_in_group(TDP) if self.elastic else list(plan.trainers)
        owned = OwnedSlices(agent, trained.trained, self.rank == min(trainers))
        self.owners = self._elastic_owners(owned, trainers) if self.elastic else \
            self._static_owners(plan, owned)
        self.owned = owned if self.rank in self.owners else None
        self.weight_bytes = sum(t.nbytes for t in self.owned.values().values()) \
            if self.owned is not None else 0

    def _static_owners(self, plan: LayoutPlan, owned: OwnedSlices) -> list[int]:
        owners = static_owners(self.ctx, plan, owned)
        if self.rank in owners:
            # Steady: the layout is static, so a version that is not checksummed and whose
            # slices are all direct (FSDP2's) goes without a header, one broadcast fewer.
            self.sender = WeightSender(self.ctx, shards_mode(self.rank),
                                       verify_every=self.verify_every,
                                       direct=direct_of(self.agent, owned.indices()), steady=True)
        for owner in owners:  # the rollout ranks learn where each owner's slices go
            if owner == self.rank:
                share_indices(self.ctx, owner, owned)
        return owners

    def _elastic_owners(self, owned: OwnedSlices, trainers: list[int]) -> list[int]:
        flags = collectives.all_gather(self.ctx, TDP, torch.tensor([[float(bool(owned.entries))]]))
        owners = [r for r, flag in zip(trainers, flags.reshape(-1).tolist()) if flag]
        if self.rank in owners:  # where its slices go, for every acting rank, once
            payload = io.BytesIO()
            torch.save(owned.indices(), payload)
            self.ctx.store.set(KEYS.indices(self.rank),
                               base64.b64encode(payload.getvalue()).decode())
        if self.rank == min(trainers):
            self.ctx.store.set(KEYS.owners(), json.dumps(owners))
        return owners

    def version_after(self, updates: int) -> int:
        return self.version

    def begin(self, members: list[int]) -> None:
        if self.elastic:
            self._form_generation(members)

    def _form_generation(self, members: list[int]) -> None:
        """The job's live members (every leader's) form the next generation of shard groups;
        an owner builds its own."""
        self.generation += 1
        most = collectives.all_reduce(self.ctx, TDP, torch.tensor([float(len(members))]),
                                      dist.ReduceOp.MAX)
        row = torch.full((1, max(int(most.item()), 1)), -1.0, dtype=torch.float64)
        row[0, : len(members)] = torch.tensor(members, dtype=torch.float64)
        everyone = collectives.all_gather(self.ctx, TDP, row).reshape(-1).tolist()
        job = sorted({int(r) for r in everyone if r >= 0})
        if self.rank == min(self.ctx.get_ranks_in_group(TDP)):
            self.ctx.store.set(KEYS.generation(self.generation), json.dumps(job))
        if self.owned is None:
            return
        assert self.patience is not None
        ranks = shard_group(self.ctx, self.rank, self.generation, job, self.patience)
        self.sender = WeightSender(self.ctx, shards_mode(self.rank),
                                   verify_every=self.verify_every, first_version=self.version,
                                   direct=direct_of(self.agent, self.owned.indices()))
        log.info("rank %d: shard generation %d: members %s", self.rank, self.generation,
                 ranks[1:])

    def sync(self, first: bool) -> None:
        """Sends its slices (the large ones from its local shards themselves: the optimizer
        steps only after :meth:`settle`)."""
        self._send(wait=first, verify=False)

    def _send(self, wait: bool, verify: bool) -> None:
        self.version += 1
        if self.sender is None or self.owned is None:
            return
        self.sender.send(self.owned.values(), wait=wait, verify=verify)
        receivers = len(self.ctx.get_ranks_in_group(shards_mode(self.rank))) - 1
        self.stats.weight_bytes_sent += receivers * self.weight_bytes

    def settle(self) -> None:
        """Elastic: a send to a lost member fails alone (its leader drops it from its segment,
        the next boundary re-forms)."""
        if self.sender is None:
            return
        if not self.elastic:
            self.sender.wait()
            return
        for err in self.sender.settle():
            log.warning("rank %d: slices to a lost member: %s", self.rank, describe_loss(err))

    def agree(self, changing: bool) -> bool:
        """Any leader's group changes: the job's (every trainer takes part)."""
        flag = torch.tensor([float(changing)])
        return bool(collectives.all_reduce(self.ctx, TDP, flag, dist.ReduceOp.MAX).item())

    def end(self, moved: bool, epoch: int) -> None:
        if moved:  # a member reads its leader's new epoch's generation once told
            self.ctx.store.set(generation_of(self.rank, epoch), str(self.generation + 1))
        if self.sender is not None:
            graveyard.append((self.sender, self.ctx.get_group(shards_mode(self.rank)),
                              self.sender.end(moved=moved)))

    def renew(self, epoch: int, members: list[int]) -> None:
        self._form_generation(members)
        self._send(wait=True, verify=True)


Part = tuple[WeightReceiver, Slices, dict[str, Placement]]


class ShardReceiver:
    """An acting rank's end: every owner's slices, assembled into whole weights (the large
    slices arrive in place). ``leader``: whose epochs it follows (elastic)."""

    sends = False
    weight_bytes = 0
    sender: WeightSender | None = None  # the taking end owns nothing to send
    owned: OwnedSlices | None = None

    def __init__(self, ctx: CommContext, plan: LayoutPlan | None, agent: nn.Module,
                 settings: HandOffSettings, leader: int | None,
                 patience: datetime.timedelta | None) -> None:
        self.ctx, self.agent, self.leader, self.patience = ctx, agent, leader, patience
        self.max_staleness = settings.max_staleness
        self.version = 0
        self.generation = -1
        # Each owner's receiver, the slices it loads and where they go in the whole weights.
        self.receivers: list[Part] = []
        self.indices: dict[int, Indices] = {}  # by owner, read once
        self.owners: list[int] = []
        if plan is not None:  # static: the groups and indices, once
            self.owners = static_owners(ctx, plan, None)
            for owner in self.owners:
                self.receivers.append(self._part(owner, share_indices(ctx, owner, None)))

    def _part(self, owner: int, indices: Indices) -> Part:
        slices = slices_for(self.agent, indices)
        receiver = WeightReceiver(self.ctx, shards_mode(owner), expected=slices.state_dict(),
                                  direct=direct_of(self.agent, indices))
        # Loads point the slices at the received bytes, and the direct ones are received
        # straight into the agent's weights: no copy.
        receiver.bind(slices)
        return receiver, slices, placements_of(indices)

    def version_after(self, updates: int) -> int:
        return self.version

    def begin(self, members: list[int]) -> None:
        if self.leader is not None:  # elastic: epoch 0 is generation 0
            self._enter_generation(0)

    def _enter_generation(self, generation: int) -> None:
        store = self.ctx.store
        self.owners = [int(r) for r in json.loads(store.get(KEYS.owners()))]
        members = [int(r) for r in json.loads(store.get(KEYS.generation(generation)))]
        self.receivers = []
        assert self.patience is not None
        for owner in self.owners:  # every rank builds the groups in owner order
            shard_group(self.ctx, owner, generation, members, self.patience)
            if owner not in self.indices:
                raw = base64.b64decode(store.get(KEYS.indices(owner)))
                self.indices[owner] = torch.load(io.BytesIO(raw))
            self.receivers.append(self._part(owner, self.indices[owner]))
        self.generation = generation

    def sync(self, first: bool) -> None:
        if first and self.version and self.receivers[0][0].version:
            return  # a joiner took its generation's first weights when it entered
        self.version = receive_weights(
            [(receiver, slices) for receiver, slices, _ in self.receivers], first,
            self.max_staleness)
        assemble(self.agent, [(slices, placements) for _, slices, placements in self.receivers])

    def settle(self) -> None:
        """Nothing is sent from here."""

    def agree(self, changing: bool) -> bool:
        return changing

    def end(self, moved: bool, epoch: int) -> None:
        for receiver, _, _ in self.receivers:
            graveyard.append((receiver, receiver.abandon()))

    def renew(self, epoch: int, members: list[int]) -> None:
        assert self.leader is not None
        generation = int(self.ctx.store.get(generation_of(self.leader, epoch)))
        self._enter_generation(generation)
        self.sync(first=True)
