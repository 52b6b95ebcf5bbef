"""Elastic rollout ranks fed by sharded trainers (``layout.elastic_rollouts`` with
``loop.data_parallel=fsdp`` or ``layout.tensor_parallel_size > 1``): the sharded hand-off's
weights over the elastic hand-off's membership epochs. No trainer gathers the model to send it.

Segments move as on the elastic path (app/runtime/handoff/elastic.py): each member sends its own
to its trainer, point to point, over that trainer's epoch group, and a lost member is dropped and
counted there. The weights move as on the sharded path (app/runtime/handoff/sharded.py): each
shard owner sends only its own slices (:class:`~app.runtime.handoff.sharded.OwnedSlices`), over
a group of its own with every live rollout rank of the job (``WEIGHT_SHARDS_<owner>``, an epoch
group of the owner's), and each rollout rank assembles the whole weights from every owner's
(:func:`~app.runtime.handoff.sharded.assemble`). Where each owner's slices go travels once, in
the store (``elastic/shards/indices/<owner>``), so a joiner reads it there.

A rollout rank takes weights from every owner, so a membership change is the job's: the trainers
step in lockstep, and at an update boundary where any trainer's group changes (a member lost, or
a joiner admitted; one all-reduce over TRAIN_DATA_PARALLEL tells) every trainer forms a new epoch
of its own group (survivors and joiners acknowledge it as on the elastic path), then the job's
live rollout ranks (their union) form the next *generation* of shard groups
(``elastic/shards/gen/<g>``, written by the first trainer; each trainer's epoch record names its
generation, ``elastic/<trainer>/gen/<epoch>``), on which each owner sends its first slices
verified whatever ``loop.verify_weights_every`` says. A member learns of the change from the
owners' "moved" header on the shard groups, follows its trainer to its new epoch, builds the
generation's shard groups in owner order and takes the verified weights.

A member lost while slices were in flight fails only its own sends (:meth:`WeightSender.settle`
waits for each on its own: at once on a closed connection, within the group's timeout on a
downed link); its trainer drops it when its segment fails, as on the elastic path, and the next
update boundary forms the next generation without it.
"""

from __future__ import annotations

import base64
import datetime
import io
import json
import logging
import time
from typing import Any

import torch

from app.runtime.handoff.base import HandOffSettings
from app.runtime.handoff.elastic import TDP, ElasticLeader
from app.runtime.handoff.elastic_member import ElasticMember
from app.runtime.handoff.flat import receive_weights
from app.runtime.handoff.sharded import (
    OwnedSlices,
    Placement,
    Slices,
    assemble,
    direct_of,
    placements_of,
    shards_mode,
    slices_for,
)
from app.runtime.segments import SegmentFormat
from rlcomm import CommContext, collectives
from rlcomm.elastic import Join, build_epoch_group, describe_loss, graveyard
from rlcomm.weights import WeightReceiver, WeightSender

log = logging.getLogger(__name__)
SPACE = "shards/"  # the shard groups' series of epochs beside an owner's own (rlcomm.elastic)
OWNERS, INDICES, GENERATION = ("elastic/shards/owners", "elastic/shards/indices/",
                               "elastic/shards/gen/")


def generation_of(trainer: int, epoch: int) -> str:
    """The store key naming the shard generation a trainer's epoch belongs to."""
    return f"elastic/{trainer}/gen/{epoch}"


def shard_group(ctx: CommContext, owner: int, generation: int, members: list[int],
                timeout: datetime.timedelta) -> list[int]:
    """Builds and registers this rank's group of ``owner``'s slices for ``generation``
    (``members``: the job's live rollout ranks); returns its ranks, owner first."""
    ranks = [owner, *members]
    group = build_epoch_group(ctx.store, owner, generation, ranks, ctx.get_global_rank(),
                              timeout, space=SPACE)
    ctx.register_epoch_group(shards_mode(owner), group, ranks)
    return ranks


class ElasticShardedLeader(ElasticLeader):
    """A sharded trainer's side (see the module's doc): segments from its own members, its
    slices to every live rollout rank of the job."""

    kind = "elastic-sharded"

    def __init__(self, ctx: CommContext, agent: torch.nn.Module, segment_format: SegmentFormat,
                 settings: HandOffSettings, hosts: dict[int, str], trained: Any) -> None:
        self.trained = trained  # the sharded module whose local shards are sent
        super().__init__(ctx, agent, segment_format, settings, hosts)

    def _start_weights(self) -> None:
        trainers = self.ctx.get_ranks_in_group(TDP)
        first = self.rank == min(trainers)
        owned = OwnedSlices(self.agent, self.trained.trained, first)
        flags = collectives.all_gather(self.ctx, TDP,
                                       torch.tensor([[float(bool(owned.entries))]]))
        self.owners = [r for r, flag in zip(trainers, flags.reshape(-1).tolist()) if flag]
        self.owned = owned if self.rank in self.owners else None
        self.shard_sender: WeightSender | None = None
        self.sent_version = 0
        self.generation = -1
        if self.owned is not None:  # where its slices go, for every rollout rank, once
            payload = io.BytesIO()
            torch.save(self.owned.indices(), payload)
            self.ctx.store.set(INDICES + str(self.rank),
                               base64.b64encode(payload.getvalue()).decode())
            self.weight_bytes = sum(t.nbytes for t in self.owned.values().values())
        else:
            self.weight_bytes = 0
        if first:
            self.ctx.store.set(OWNERS, json.dumps(self.owners))
        self._form_generation()

    def version(self, updates: int) -> int:
        return self.sent_version

    def _changing(self, joins: list[Join]) -> bool:
        """Any trainer's group changes: the job's (every trainer takes part)."""
        return self._anywhere(bool(joins or self.dropped))

    def _admitting(self, joins: list[Join]) -> bool:
        return self._anywhere(bool(joins))

    def _anywhere(self, here: bool) -> bool:
        flag = torch.tensor([float(here)])
        return bool(collectives.all_reduce(self.ctx, TDP, flag,
                                           torch.distributed.ReduceOp.MAX).item())

    def _form_generation(self) -> None:
        """The job's live rollout ranks (every trainer's members) form the next generation of
        shard groups; an owner builds its own."""
        self.generation += 1
        most = collectives.all_reduce(self.ctx, TDP, torch.tensor([float(len(self.members))]),
                                      torch.distributed.ReduceOp.MAX)
        row = torch.full((1, max(int(most.item()), 1)), -1.0, dtype=torch.float64)
        row[0, : len(self.members)] = torch.tensor(self.members, dtype=torch.float64)
        everyone = collectives.all_gather(self.ctx, TDP, row).reshape(-1).tolist()
        members = sorted({int(r) for r in everyone if r >= 0})
        if self.rank == min(self.ctx.get_ranks_in_group(TDP)):
            self.ctx.store.set(GENERATION + str(self.generation), json.dumps(members))
        if self.owned is None:
            return
        ranks = shard_group(self.ctx, self.rank, self.generation, members, self.patience)
        self.shard_sender = WeightSender(self.ctx, shards_mode(self.rank),
                                         verify_every=self.verify_every,
                                         first_version=self.sent_version,
                                         direct=direct_of(self.agent, self.owned.indices()))
        log.info("rank %d: shard generation %d: rollout ranks %s", self.rank, self.generation,
                 ranks[1:])

    def _send_weights(self, first: bool) -> None:
        self.sent_version += 1
        self._send(wait=first, verify=False)

    def _send(self, wait: bool, verify: bool) -> None:
        if self.shard_sender is None or self.owned is None:
            return
        self.shard_sender.send(self.owned.values(), wait=wait, verify=verify)
        receivers = len(self.ctx.get_ranks_in_group(shards_mode(self.rank))) - 1
        self.weight_bytes_sent += receivers * self.weight_bytes

    def _end_weights(self, moved: bool) -> None:
        if moved:  # a member reads its trainer's new epoch's generation once told
            self.ctx.store.set(generation_of(self.rank, self.epoch), str(self.generation + 1))
        if self.shard_sender is not None:
            sender = self.shard_sender
            graveyard.append((sender, self.ctx.get_group(shards_mode(self.rank)),
                              sender.end(moved=moved)))

    def _first_weights(self) -> None:
        self._form_generation()
        self.sent_version += 1
        self._send(wait=True, verify=True)

    def before_optimizer_step(self) -> None:
        """The last slices sent must be out of the send buffers; a send to a lost member fails
        alone (its trainer drops it from its segment, the next boundary re-forms)."""
        if self.shard_sender is None:
            return
        tick = time.perf_counter()
        for err in self.shard_sender.settle():
            log.warning("rank %d: slices to a lost rollout rank: %s", self.rank,
                        describe_loss(err))
        self.transfer_s += time.perf_counter() - tick


class ElasticShardedMember(ElasticMember):
    """A rollout rank's side (see the module's doc): its segments to its trainer, the slices of
    every owner from the job's shard groups, assembled into whole weights."""

    kind = "elastic-sharded"

    def __init__(self, ctx: CommContext, agent: torch.nn.Module, segment_format: SegmentFormat,
                 leader: int, settings: HandOffSettings, joining: bool) -> None:
        # Each owner's receiver, the slices it loads and where they go in the whole weights.
        self.parts: list[tuple[WeightReceiver, Slices, dict[str, Placement]]] = []
        self.indices: dict[int, dict[str, torch.Tensor | None]] = {}  # by owner, read once
        self.generation = -1
        super().__init__(ctx, agent, segment_format, leader, settings, joining)

    def _start_weights(self) -> None:  # epoch 0: generation 0
        self._enter_generation(0)

    def _enter_generation(self, generation: int) -> None:
        store = self.ctx.store
        owners = [int(r) for r in json.loads(store.get(OWNERS))]
        members = [int(r) for r in json.loads(store.get(GENERATION + str(generation)))]
        self.parts = []
        for owner in owners:  # every rank builds the groups in owner order
            shard_group(self.ctx, owner, generation, members, self.patience)
            if owner not in self.indices:
                raw = base64.b64decode(store.get(INDICES + str(owner)))
                self.indices[owner] = torch.load(io.BytesIO(raw))
            indices = self.indices[owner]
            slices = slices_for(self.agent, indices)
            receiver = WeightReceiver(self.ctx, shards_mode(owner),
                                      expected=slices.state_dict(),
                                      direct=direct_of(self.agent, indices))
            # Loads point the slices at the received bytes, and the direct ones are received
            # straight into the agent's weights: no copy.
            receiver.bind(slices)
            self.parts.append((receiver, slices, placements_of(indices)))
        self.generation = generation

    def _first_weights(self) -> None:
        generation = int(self.ctx.store.get(generation_of(self.leader, self.epoch)))
        self._enter_generation(generation)
        self._take_weights(first=True)

    def _abandon_weights(self) -> None:
        for receiver, _, _ in self.parts:
            graveyard.append((receiver, receiver.abandon()))

    def _take_weights(self, first: bool) -> None:
        if first and self.acting_version and self.parts[0][0].version:
            return  # a joiner took its generation's first weights when it entered
        self.acting_version = receive_weights(
            [(receiver, slices) for receiver, slices, _ in self.parts], first,
            self.max_staleness)
        assemble(self.agent, [(slices, placements) for _, slices, placements in self.parts])
