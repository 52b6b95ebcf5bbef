"""The trainers' membership: TRAIN_DATA_PARALLEL as epochs of the trainers
(``layout.elastic_trainers``, docs/failures.md): rlcomm.elastic's one membership, with the RL
runtime's policy.

The lead trainer (the plan's first: it holds the run's records and decisions) leads; the other
trainers are members. Epoch 0 is the planned trainers, built as an epoch group whose timeout is
half the patience. Every collective over TRAIN_DATA_PARALLEL goes through rlcomm.collectives,
which on a failure calls :meth:`TrainerGroup.recover` (the context's recovery for the mode,
``ctx.recovery``) and runs the call again on the group it forms:

- the lead proposes the next epoch with every member; a live member, whose call on the old
  group failed too, acknowledges it; one whose process on the lead's host has ended, or that
  neither acknowledges nor beats its heartbeat for ``BEAT_LOST_S``, is lost ("killed" when its
  connection closed, else "timed out"), and the patience bounds the wait for any;
- the survivors build the epoch's group; the lost trainers' rollout ranks move to them (the
  ``moved`` records that the rollout ranks' membership reads, app/runtime/membership/rollouts.py);
- a member the lead took for lost learns it on its next call and leaves (PeerLostError: under
  the local launcher its slot starts it again while ``launcher.trainer_restarts`` allow).

A new process for a lost trainer asks to join; at an update boundary (:meth:`boundary`) the
trainers agree on admitting it, form the next epoch with it, and it heals from the lead
(app/runtime/trainers/healing.py). The update that a loss broke is the trainer role's to redo
(app/runtime/roles/trainer.py): no optimizer steps on a gradient of two groups.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from app.runtime.membership.replicas import whole_replica_groups
from app.runtime.membership.rollouts import JOIN_DETAILS
from rlcomm import CommContext, ParallelMode, collectives
from rlcomm.elastic import (
    CallCommit,
    Change,
    Join,
    Keys,
    Leader,
    Liveness,
    Member,
    close_membership,
    closing_members,
    epoch_members,
    latest_epoch,
    moved,
)
from rlcomm.errors import MembersLostError, PeerLostError
from rlcomm.net.gloo_words import describe_loss

log = logging.getLogger(__name__)

TDP = ParallelMode.TRAIN_DATA_PARALLEL
# The trainers' epochs: a series of their own under their lead (keys and groups under
# elastic/<lead>/trainers/), beside the lead's own series of rollout ranks.
SPACE = "trainers/"


Adopt = Callable[[list[int]], None]  # this trainer takes these rollout ranks


class TrainerGroup:
    """This trainer's side of the trainers' membership (see the module's doc). ``trainers``:
    the planned ones, lead first; ``adopt``: told which lost trainers' rollout ranks this one
    takes; ``joining``: this process replaces a lost trainer; ``holds``: what this trainer alone
    holds (its own replay shard's transitions), lost with it and counted."""

    def __init__(self, ctx: CommContext, trainers: list[int], hosts: dict[int, str],
                 patience: datetime.timedelta, adopt: Adopt, joining: bool = False,
                 holds: Callable[[], int] | None = None,
                 replicas: tuple[tuple[int, ...], ...] = ()) -> None:
        self.ctx, self.adopt, self.joining, self.holds = ctx, adopt, joining, holds
        # Replica groups of sharded trainers (layout.trainer_replicas): a lost rank takes its
        # whole replica group out, since none of its shards can be rebuilt from the others.
        self.replicas = replicas
        self.asked: dict[int, Join] = {}  # the lead's: joins waiting for their replica group
        self.lead, self.rank = trainers[0], ctx.get_global_rank()
        self.patience, self.patience_s = patience, patience.total_seconds()
        self.hosts = dict(hosts)
        self.planned = list(trainers)
        self.members = list(trainers)  # every live trainer, lead first
        self.epoch = 0
        self.update = 0  # the update being made, for the records
        self.epoch_at_start = 0  # the epoch that update started in
        self.keys = Keys(self.lead, SPACE)
        self.side: Leader | Member | None = None  # the lead's, or a member's (begin)
        self.liveness = Liveness(ctx.store, self.keys, self.hosts)
        self.commits = CallCommit(ctx.store, self.keys, self.rank, self.liveness,
                                  lambda: self.epoch, lambda: self.members)
        self.stopped = False

    @property
    def leads(self) -> bool:
        return self.rank == self.lead

    @property
    def changes(self) -> list[Change]:
        """Who left and joined the trainers (the lead's records)."""
        return self.side.changes if isinstance(self.side, Leader) else []

    def _leader(self) -> Leader:
        assert isinstance(self.side, Leader), "only the lead trainer leads"
        return self.side

    def _member(self) -> Member:
        assert isinstance(self.side, Member), "the lead trainer follows nobody"
        return self.side

    # ---- forming -------------------------------------------------------------------------

    def begin(self) -> None:
        """Forms (or, joining, asks to be admitted to) the trainers' group; from here on a
        failed call over TRAIN_DATA_PARALLEL recovers through this group."""
        self.liveness.start(self.rank)
        # Half the patience: the trainers settle a loss among them before their rollout ranks'
        # groups, whose timeout is the whole patience, give up on a trainer that waited.
        timeout = self.patience / 2
        if self.leads:
            self.side = Leader(self.ctx, TDP, self.planned, self.hosts, timeout, space=SPACE,
                               watch=self._broken)
        else:
            self.side = Member(self.ctx, TDP, self.lead, timeout, space=SPACE,
                               watch=self._broken)
        if self.joining:
            self._join()
        else:
            self._register(0, self.planned)
        self.ctx.recovery.set(TDP, self.recover)
        if self.replicas:  # rlcomm/elastic/commit.py: why sharded trainers need it
            self.ctx.recovery.commit_with(TDP, self.commits.commit)

    def _broken(self, epoch: int) -> Callable[[], bool]:
        broken = self.keys.broken(epoch)
        return lambda: bool(self.ctx.store.check([broken]))

    def _register(self, epoch: int, members: list[int]) -> None:
        """``epoch``'s group of the trainers ``members`` (lead first), formed and registered."""
        if isinstance(self.side, Leader):
            self.side.form()
        else:
            self._member().enter(epoch, members)
        self._entered(epoch, members)

    def _entered(self, epoch: int, members: list[int]) -> None:
        self.epoch, self.members = epoch, list(members)
        self.commits.reset()
        self.liveness.note(members)

    def _join(self) -> None:
        member = self._member()
        log.info("rank %d asks the lead trainer, rank %d, to admit it", self.rank, self.lead)
        members = member.join(self.ctx.timeout.total_seconds(), again=False)
        if members is None:
            raise PeerLostError(f"rank {self.rank} (trainer): admitted to the trainers but "
                                "answered too late")
        self._entered(member.epoch, members)
        log.info("rank %d: in epoch %d of the trainers %s", self.rank, self.epoch, members)

    # ---- losing --------------------------------------------------------------------------

    def recover(self, err: BaseException) -> bool:
        """A call over TRAIN_DATA_PARALLEL failed with ``err``: the next epoch of the trainers
        is registered (True), or the run stopped meanwhile (False). Raises when this trainer
        was taken for lost, or when every other trainer is."""
        if self.stopped:
            return False
        # Declared broken first: a trainer still waiting on the group gives up at once (gloo
        # tells only those connected to the lost one), and the lead learns what was seen.
        broken = self.keys.broken(self.epoch)
        if not self.ctx.store.check([broken]):
            self.ctx.store.set(broken, describe_loss(err))
        if self.leads:
            self._drop_lost(self.ctx.store.get(broken).decode())
        else:
            self._follow_lead(err)
        return True

    def _drop_lost(self, why: str) -> None:
        """The lead: the next epoch with the trainers that answer; ``why``: what the first
        trainer to see the group fail saw ("connection closed": a process ended)."""
        leader, store, keys = self._leader(), self.ctx.store, self.keys
        others = self.members[1:]
        gone = self.liveness.watch(others)
        epoch = leader.propose(others, [])
        tick = time.perf_counter()
        lost = leader.settle(self.patience_s, gone=gone, along=self._replica_mates)
        # Those that answered, out with a lost rank's replica group.
        along = [r for r in lost if store.check([keys.ack(epoch, r)])]
        own = [r for r in self._replica_mates([self.lead]) if r in lost]
        if own:  # its shards cannot go on without them, and it holds the run's records
            raise MembersLostError(f"rank(s) {own} of the lead trainer's replica group were "
                                   f"lost ({why}): that group is not elastic")
        survivors = [self.lead, *leader.members]
        reason = "killed" if "closed" in why else "timed out"
        if along:
            store.set(keys.key(f"along/{epoch}"), json.dumps(along))
        adopted = deal([m for rank in lost for m in rollout_ranks(store, rank)], survivors)
        store.set(keys.key(f"adopted/{epoch}"), json.dumps(adopted))
        for rank in lost:
            change = self._record("leave", rank, "with its replica group" if rank in along
                                  else reason, epoch)
            held = keys.key(f"held/{rank}")
            if store.check([held]):
                change.details["lost_transitions"] = int(store.get(held))
        self._register(epoch, survivors)
        for survivor, ranks in adopted.items():
            for orphan in ranks:  # after the epoch formed: a survivor that takes it knows
                store.set(moved(orphan), str(survivor))
        self.adopt(adopted.get(str(self.lead), []))
        serving = sorted({r for ranks in adopted.values() for r in ranks}
                         | {r for s in survivors for r in rollout_ranks(store, s)})
        for rank in lost:
            log.warning("rank %d (trainer) left: %s; %d trainer%s go%s on, serving rollout "
                        "ranks %s (epoch %d, formed in %.3f s)", rank, why, len(survivors),
                        "" if len(survivors) == 1 else "s", "es" if len(survivors) == 1 else "",
                        ", ".join(map(str, serving)) or "none", epoch,
                        time.perf_counter() - tick)
        if not lost:
            log.warning("rank %d: the trainers' group failed (%s) but every trainer answered; "
                        "epoch %d formed", self.rank, why, epoch)

    def _replica_mates(self, lost: list[int]) -> list[int]:
        """The other ranks of the replica groups that hold ``lost`` ranks (none without)."""
        return [r for block in self.replicas if set(block) & set(lost) for r in block]

    def _follow_lead(self, err: BaseException) -> None:
        """A member: waits for the lead's next epoch and goes to it; raises if the lead left
        this trainer out (it took it for lost) or formed none within the patience."""
        member, store = self._member(), self.ctx.store
        epoch = member.newer_epoch(2 * self.patience_s, stopped=lambda: closing_members(
            store, self.lead, SPACE) is not None)
        if epoch is None:  # the run stopped meanwhile
            raise PeerLostError(f"rank {self.rank} (trainer): the run stopped while its "
                                f"group failed ({describe_loss(err)})") from err
        if epoch <= self.epoch:
            raise err
        members = member.acknowledge(epoch)
        if members is None:
            why = f"it did not answer within the patience, {self.patience_s:g} s"
            along = self.keys.key(f"along/{epoch}")
            if store.check([along]) and self.rank in json.loads(store.get(along)):
                why = "a rank of its replica group was lost, and the group leaves whole"
            raise PeerLostError(
                f"rank {self.rank} (trainer): left the trainers: the lead, rank {self.lead}, "
                f"formed epoch {epoch} without it ({why}; its group: {describe_loss(err)})"
            ) from err
        adopted = json.loads(store.get(self.keys.key(f"adopted/{epoch}")))
        self._register(epoch, members)
        self.adopt(adopted.get(str(self.rank), []))
        log.warning("rank %d: the trainers' group failed (%s); in epoch %d with %s",
                    self.rank, describe_loss(err), epoch, members)

    # ---- joining -------------------------------------------------------------------------

    def boundary(self, heal: Callable[[list[int]], None]) -> None:
        """At an update boundary, on every trainer: admits the processes that asked to join
        (every trainer agrees first) and heals them (``heal(joined)``, over the new group)."""
        joins = self.side.pending_joins() if isinstance(self.side, Leader) else []
        if self.replicas:  # a replica group is admitted whole (app/runtime/membership/replicas.py)
            self.asked.update({join.rank: join for join in joins})
            ready = whole_replica_groups(self.asked, self.replicas, self.members)
            joins = [self.asked.pop(rank) for rank in ready]
        flag = collectives.all_reduce(self.ctx, TDP, torch.tensor([float(len(joins))]))
        if not flag.item():
            return
        joined = self._admit(joins) if self.leads else self._follow_admission()
        heal(joined)

    def _admit(self, joins: list[Join]) -> list[int]:
        leader = self._leader()
        joining = sorted({j.rank for j in joins if j.rank not in self.members})
        for join in joins:  # where liveness looks for their processes
            self.hosts[join.rank] = join.host
        epoch = leader.propose([*self.members[1:], *joining], joins)
        missing = leader.settle(self.patience_s)
        self.ctx.store.set(self.keys.key(f"adopted/{epoch}"), "{}")
        members = [self.lead, *leader.members]
        self._register(epoch, members)
        joined = [r for r in joining if r not in missing]
        for rank in joined:
            self._record("join", rank, "joined", epoch)
        return joined

    def _follow_admission(self) -> list[int]:
        member, before = self._member(), list(self.members)
        epoch = member.newer_epoch(self.patience_s)
        assert epoch is not None  # nothing stops the wait
        if epoch <= self.epoch:
            raise MembersLostError(f"rank {self.rank} (trainer): the lead formed no epoch "
                                   f"within {self.patience_s:g} s to admit a trainer")
        members = member.acknowledge(epoch)
        if members is None:
            raise PeerLostError(f"rank {self.rank} (trainer): left out of epoch {epoch}")
        self._register(epoch, members)
        return [r for r in members if r not in before]

    # ---- records -------------------------------------------------------------------------

    def _record(self, event: str, rank: int, reason: str, epoch: int) -> Change:
        change = self._leader().note(event, rank, reason, self.update, epoch)
        if event == "join":  # as a joining rollout rank's record, without its figures
            change.details = dict.fromkeys(JOIN_DETAILS)
        return change

    def start_update(self, update: int) -> None:
        self.update, self.epoch_at_start = update, self.epoch

    def update_done(self) -> bool:
        """After an update: how long the survivors took to their next one; what this trainer
        alone holds, where the lead reads it if this one is lost. True: the trainers changed
        during the update."""
        if self.holds is not None:
            self.ctx.store.set(self.keys.key(f"held/{self.rank}"), str(self.holds()))
        if isinstance(self.side, Leader):
            self.side.changes.settled()
        return self.epoch != self.epoch_at_start

    def stop(self) -> None:
        """The run stopped: the live trainers, for the reports and any member in recovery."""
        self.stopped = True
        self.liveness.stop()
        if self.leads:
            close_membership(self.ctx.store, self.lead, self.members, SPACE)
        self.ctx.recovery.set(TDP, None)
        self.ctx.recovery.commit_with(TDP, None)

    def result(self) -> dict[str, Any]:
        """The trainers' epoch and who left and joined them (the lead's record)."""
        return {"trainer_epoch": self.epoch, "trainers": list(self.members),
                "trainer_changes": [c.record() for c in self.changes]}


def rollout_ranks(store: Any, trainer: int) -> list[int]:
    """The members of ``trainer``'s latest group of rollout ranks (none if it has none)."""
    if not store.check([Keys(trainer).latest()]):
        return []
    return epoch_members(store, trainer, latest_epoch(store, trainer))[1:]


def deal(orphans: list[int], survivors: list[int]) -> dict[str, list[int]]:
    """Lost trainers' rollout ranks, dealt round robin over the survivors (by survivor)."""
    adopted: dict[str, list[int]] = {str(s): [] for s in survivors}
    for i, orphan in enumerate(sorted(orphans)):
        adopted[str(survivors[i % len(survivors)])].append(orphan)
    return adopted
