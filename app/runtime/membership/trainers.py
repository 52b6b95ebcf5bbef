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
(app/runtime/membership/healing.py). The update that a loss broke is the trainer role's to redo
(app/runtime/trainer/role.py): no optimizer steps on a gradient of two groups.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from app.runtime.core import stopping
from app.runtime.membership.replicas import announced_replica, whole_replica_groups
from app.runtime.membership.rollouts import ASKED, JOIN_DETAILS
from rlcomm import CommContext, ParallelMode, collectives
from rlcomm.elastic import (
    BEYOND_PLAN,
    CallCommit,
    Change,
    Join,
    Keys,
    Leader,
    Liveness,
    Member,
    ask_to_leave,
    close_membership,
    closing_members,
    epoch_members,
    latest_epoch,
    moved,
    was_let_go,
)
from rlcomm.errors import MembersLostError, PeerLostError
from rlcomm.net.gloo_words import describe_loss

log = logging.getLogger(__name__)

TDP = ParallelMode.TRAIN_DATA_PARALLEL
# The trainers' epochs: a series of their own under their lead (keys and groups under
# elastic/<lead>/trainers/), beside the lead's own series of rollout ranks.
SPACE = "trainers/"


Adopt = Callable[[list[int]], None]  # this trainer takes these rollout ranks


class LeftWhenAsked(Exception):
    """This trainer was let go at its request (SIGTERM to it alone, ``python -m app.leave``):
    its run ends here, cleanly, and the others go on."""


class TrainerGroup:
    """This trainer's side of the trainers' membership (see the module's doc). ``trainers``:
    the planned ones, lead first; ``adopt``: told which lost trainers' rollout ranks this one
    takes; ``joining``: this process replaces a lost trainer; ``holds``: what this trainer alone
    holds (its own replay shard's transitions), lost with it and counted. What only the lead
    does is :class:`Lead`'s; what only the others do, :class:`Following`'s."""

    def __init__(self, ctx: CommContext, trainers: list[int], hosts: dict[int, str],
                 patience: datetime.timedelta, adopt: Adopt, joining: bool = False,
                 holds: Callable[[], int] | None = None,
                 replicas: tuple[tuple[int, ...], ...] = ()) -> None:
        self.ctx, self.adopt, self.joining, self.holds = ctx, adopt, joining, holds
        # Replica groups of sharded trainers (layout.trainer_replicas): a lost rank takes its
        # whole replica group out, since none of its shards can be rebuilt from the others.
        self.replicas = replicas
        self.lead, self.rank = trainers[0], ctx.get_global_rank()
        self.patience, self.patience_s = patience, patience.total_seconds()
        self.hosts = dict(hosts)
        self.planned = list(trainers)
        self.members = list(trainers)  # every live trainer, lead first
        self.epoch = 0
        self.update = 0  # the update being made, for the records
        self.epoch_at_start = 0  # the epoch that update started in
        self.keys = Keys(self.lead, SPACE)
        self.liveness = Liveness(ctx.store, self.keys, self.hosts)
        self.commits = CallCommit(ctx.store, self.keys, self.rank, self.liveness,
                                  lambda: self.epoch, lambda: self.members)
        self.side: Lead | Following | None = None  # begin
        self.stopped = False
        self.leaving = False  # it asked to leave (SIGTERM to it alone)

    @property
    def leads(self) -> bool:
        return self.rank == self.lead

    @property
    def changes(self) -> list[Change]:
        """Who left and joined the trainers (the lead's records)."""
        return self.side.leader.changes if isinstance(self.side, Lead) else []

    def begin(self) -> None:
        """Forms (or, joining, asks to be admitted to) the trainers' group; from here on a
        failed call over TRAIN_DATA_PARALLEL recovers through this group."""
        self.liveness.start(self.rank)
        self.side = Lead(self) if self.leads else Following(self)
        if self.joining:
            assert isinstance(self.side, Following), "the lead is never a joiner"
            self.side.join()
        else:
            self.register(0, self.planned)
        self.ctx.recovery.set(TDP, self.recover)
        if self.replicas:  # rlcomm/elastic/commit.py: why sharded trainers need it
            self.ctx.recovery.commit_with(TDP, self.commits.commit)

    def broken(self, epoch: int) -> Callable[[], bool]:
        """Whether a trainer declared ``epoch``'s group broken."""
        broken = self.keys.broken(epoch)
        return lambda: bool(self.ctx.store.check([broken]))

    def register(self, epoch: int, members: list[int]) -> None:
        """``epoch``'s group of the trainers ``members`` (lead first), formed and registered."""
        assert self.side is not None
        self.side.form(epoch, members)
        self.entered(epoch, members)

    def entered(self, epoch: int, members: list[int]) -> None:
        self.epoch, self.members = epoch, list(members)
        self.commits.reset()
        self.liveness.note(members)

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
        assert self.side is not None
        if isinstance(self.side, Lead):
            self.side.drop_lost(self.ctx.store.get(broken).decode())
        else:
            self.side.follow_lead(err)
        return True

    @property
    def may_leave(self) -> bool:
        """Whether this trainer can leave when asked: not the lead (it holds the run's records
        and decisions), nor a rank of a replica group (its shards go only with the group)."""
        return not self.leads and not self.replicas

    def votes_stop(self) -> bool:
        """Whether this trainer asks the others to stop the run (SIGTERM): a trainer that can
        leave asks to leave instead, and the run stops only if the lead was asked too."""
        return stopping.asked() and not self.may_leave

    def boundary(self, heal: Callable[[list[int]], None]) -> None:
        """At an update boundary, on every trainer: lets go those that asked to leave, then
        admits the processes that asked to join (every trainer agrees first) and heals them
        (``heal(joined)``, over the new group). Raises :class:`LeftWhenAsked` on a trainer
        let go."""
        side = self.side
        if self.may_leave and stopping.asked() and not self.leaving:
            self.leaving = True
            ask_to_leave(self.ctx.store, self.rank, ASKED)
            log.warning("rank %d (trainer): asked to stop (%s); it leaves the trainers at the "
                        "next update boundary", self.rank, stopping.reason())
        joins = side.pending_joins() if isinstance(side, Lead) else []
        leaves = side.pending_leaves() if isinstance(side, Lead) else []
        flag = collectives.all_reduce(self.ctx, TDP,
                                      torch.tensor([float(len(joins)), float(len(leaves))]))
        assert side is not None
        if flag[1].item():
            if isinstance(side, Lead):
                side.let_go(leaves)
            else:
                side.follow(ASKED)
        if flag[0].item():
            heal(side.admit(joins) if isinstance(side, Lead) else side.follow("admitted"))

    def start_update(self, update: int) -> None:
        self.update, self.epoch_at_start = update, self.epoch

    def update_done(self) -> bool:
        """After an update: how long the survivors took to their next one; what this trainer
        alone holds, where the lead reads it if this one is lost. True: the trainers changed
        during the update."""
        if self.holds is not None:
            self.ctx.store.set(self.keys.key(f"held/{self.rank}"), str(self.holds()))
        if isinstance(self.side, Lead):
            self.side.leader.changes.settled()
        return self.epoch != self.epoch_at_start

    def stop(self) -> None:
        """The run stopped: the live trainers, for the reports and any member in recovery."""
        self.stopped = True
        if self.leads:
            close_membership(self.ctx.store, self.lead, self.members, SPACE)
        self.leave()

    def leave(self) -> None:
        """This trainer is done with the others: no heartbeats, no recovery over its group."""
        self.liveness.stop()
        self.ctx.recovery.set(TDP, None)
        self.ctx.recovery.commit_with(TDP, None)

    def result(self) -> dict[str, Any]:
        """The trainers' epoch and who left and joined them (the lead's record)."""
        return {"trainer_epoch": self.epoch, "trainers": list(self.members),
                "trainer_changes": [c.record() for c in self.changes]}


def _timeout(group: TrainerGroup) -> datetime.timedelta:
    # Half the patience: the trainers settle a loss among them before their rollout ranks'
    # groups, whose timeout is the whole patience, give up on a trainer that waited.
    return group.patience / 2


class Lead:
    """What the lead trainer alone does: it keeps the trainers' records, drops the lost and
    admits the joiners (rlcomm.elastic.Leader)."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group
        self.leader = Leader(group.ctx, TDP, group.planned, group.hosts, _timeout(group),
                             space=SPACE, watch=group.broken)
        self.asked: dict[int, Join] = {}  # joins waiting for their replica group

    def form(self, epoch: int, members: list[int]) -> None:
        self.leader.form()

    def pending_joins(self) -> list[Join]:
        """The joins to admit now: every one, or with replica groups those whose whole group
        asked (app/runtime/membership/replicas.py)."""
        group, joins = self.group, self.leader.pending_joins()
        if not group.replicas:
            return joins
        for join in joins:  # a replica group beyond the plan: the lead learns its ranks
            block = announced_replica(group.ctx.store, group.keys, join.rank)
            if join.beyond_plan and block and block not in group.replicas:
                group.replicas = (*group.replicas, block)
        self.asked.update({join.rank: join for join in joins})
        ready = whole_replica_groups(self.asked, group.replicas, group.members)
        return [self.asked.pop(rank) for rank in ready]

    def pending_leaves(self) -> list[int]:
        """The trainers that asked to leave, to let go now: none while the lead itself was
        asked to stop (a SIGTERM to every rank stops the run instead) or with replica groups."""
        asked = sorted(self.leader.pending_leaves())
        return [] if stopping.asked() or self.group.replicas else asked

    def let_go(self, ranks: list[int]) -> None:
        """The next epoch without ``ranks``, which asked to leave; their rollout ranks go to
        the others, as a lost trainer's do."""
        group, leader = self.group, self.leader
        tick = time.perf_counter()
        for rank in ranks:
            leader.let_go(rank)
        epoch = leader.propose([r for r in group.members[1:] if r not in ranks], [])
        late = leader.settle(group.patience_s)  # a trainer that did not answer is lost
        self.hand_over({**dict.fromkeys(ranks, ASKED), **dict.fromkeys(late, "timed out")},
                       "asked to leave", epoch, tick)

    def drop_lost(self, why: str) -> None:
        """The next epoch with the trainers that answer; ``why``: what the first trainer to
        see the group fail saw ("connection closed": a process ended)."""
        group, leader = self.group, self.leader
        store, keys = group.ctx.store, group.keys
        others = group.members[1:]
        gone = group.liveness.watch(others)
        epoch = leader.propose(others, [])
        tick = time.perf_counter()
        lost = leader.settle(group.patience_s, gone=gone, along=self.replica_mates)
        # Those that answered, out with a lost rank's replica group.
        along = [r for r in lost if store.check([keys.ack(epoch, r)])]
        own = [r for r in self.replica_mates([group.lead]) if r in lost]
        if own:  # its shards cannot go on without them, and it holds the run's records
            raise MembersLostError(f"rank(s) {own} of the lead trainer's replica group were "
                                   f"lost ({why}): that group is not elastic")
        reason = "killed" if "closed" in why else "timed out"
        if along:
            store.set(keys.key(f"along/{epoch}"), json.dumps(along))
        self.hand_over({r: "with its replica group" if r in along else reason for r in lost},
                       why, epoch, tick)
        if not lost:
            log.warning("rank %d: the trainers' group failed (%s) but every trainer answered; "
                        "epoch %d formed", group.rank, why, epoch)

    def hand_over(self, gone: dict[int, str], why: str, epoch: int, tick: float) -> None:
        """``epoch`` settled without the trainers ``gone`` (rank -> the reason recorded): their
        rollout ranks are dealt to the survivors, the leaves recorded, the epoch registered."""
        group, store, keys = self.group, self.group.ctx.store, self.group.keys
        survivors = [group.lead, *self.leader.members]
        adopted = deal([m for rank in gone for m in rollout_ranks(store, rank)], survivors)
        store.set(keys.key(f"adopted/{epoch}"), json.dumps(adopted))
        for rank, reason in gone.items():
            change = self.record("leave", rank, reason, epoch)
            held = keys.key(f"held/{rank}")
            if store.check([held]):
                change.details["lost_transitions"] = int(store.get(held))
        group.register(epoch, survivors)
        for survivor, ranks in adopted.items():
            for orphan in ranks:  # after the epoch formed: a survivor that takes it knows
                store.set(moved(orphan), str(survivor))
        group.adopt(adopted.get(str(group.lead), []))
        serving = sorted({r for ranks in adopted.values() for r in ranks}
                         | {r for s in survivors for r in rollout_ranks(store, s)})
        for rank in gone:
            log.warning("rank %d (trainer) left: %s; %d trainer%s go%s on, serving rollout "
                        "ranks %s (epoch %d, formed in %.3f s)", rank, why, len(survivors),
                        "" if len(survivors) == 1 else "s", "es" if len(survivors) == 1 else "",
                        ", ".join(map(str, serving)) or "none", epoch,
                        time.perf_counter() - tick)

    def replica_mates(self, lost: list[int]) -> list[int]:
        """The other ranks of the replica groups that hold ``lost`` ranks (none without)."""
        return [r for block in self.group.replicas if set(block) & set(lost) for r in block]

    def admit(self, joins: list[Join]) -> list[int]:
        """The next epoch with ``joins``' processes; returns the ranks admitted."""
        group, leader = self.group, self.leader
        joining = sorted({j.rank for j in joins if j.rank not in group.members})
        for join in joins:  # where liveness looks for their processes
            group.hosts[join.rank] = join.host
        epoch = leader.propose([*group.members[1:], *joining], joins)
        missing = leader.settle(group.patience_s)
        group.ctx.store.set(group.keys.key(f"adopted/{epoch}"), "{}")
        group.register(epoch, [group.lead, *leader.members])
        joined = [r for r in joining if r not in missing]
        beyond = {j.rank for j in joins if j.beyond_plan}
        for rank in joined:
            self.record("join", rank, BEYOND_PLAN if rank in beyond else "joined", epoch)
        return joined

    def record(self, event: str, rank: int, reason: str, epoch: int) -> Change:
        change = self.leader.note(event, rank, reason, self.group.update, epoch)
        if event == "join":  # as a joining rollout rank's record, without its figures
            change.details = dict.fromkeys(JOIN_DETAILS)
        return change


class Following:
    """What the other trainers do: they follow the lead to each epoch, or ask to be admitted
    (rlcomm.elastic.Member)."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group
        self.member = Member(group.ctx, TDP, group.lead, _timeout(group), space=SPACE,
                             watch=group.broken)

    def form(self, epoch: int, members: list[int]) -> None:
        self.member.enter(epoch, members)

    def join(self) -> None:
        """This process replaces a lost trainer: it asks the lead to admit it."""
        group = self.group
        log.info("rank %d asks the lead trainer, rank %d, to admit it", group.rank, group.lead)
        members = self.member.join(group.ctx.timeout.total_seconds(), again=False)
        if members is None:
            raise PeerLostError(f"rank {group.rank} (trainer): admitted to the trainers but "
                                "answered too late")
        group.entered(self.member.epoch, members)
        log.info("rank %d: in epoch %d of the trainers %s", group.rank, group.epoch, members)

    def follow_lead(self, err: BaseException) -> None:
        """Waits for the lead's next epoch and goes to it; raises if the lead left this
        trainer out (it took it for lost) or formed none within the patience."""
        group, store = self.group, self.group.ctx.store
        epoch = self.member.newer_epoch(2 * group.patience_s, stopped=lambda: closing_members(
            store, group.lead, SPACE) is not None)
        if epoch is None:  # the run stopped meanwhile
            raise PeerLostError(f"rank {group.rank} (trainer): the run stopped while its "
                                f"group failed ({describe_loss(err)})") from err
        if epoch <= group.epoch:
            raise err
        members = self.member.acknowledge(epoch)
        if members is None:
            why = f"it did not answer within the patience, {group.patience_s:g} s"
            along = group.keys.key(f"along/{epoch}")
            if store.check([along]) and group.rank in json.loads(store.get(along)):
                why = "a rank of its replica group was lost, and the group leaves whole"
            raise PeerLostError(
                f"rank {group.rank} (trainer): left the trainers: the lead, rank {group.lead}, "
                f"formed epoch {epoch} without it ({why}; its group: {describe_loss(err)})"
            ) from err
        adopted = json.loads(store.get(group.keys.key(f"adopted/{epoch}")))
        group.register(epoch, members)
        group.adopt(adopted.get(str(group.rank), []))
        log.warning("rank %d: the trainers' group failed (%s); in epoch %d with %s",
                    group.rank, describe_loss(err), epoch, members)

    def follow(self, why: str) -> list[int]:
        """The lead formed an epoch at the boundary (``why``: it admitted a trainer, or let one
        go that asked): into it, taking any rollout ranks dealt to this trainer; returns the
        ranks that came in. Raises :class:`LeftWhenAsked` where it let this trainer go."""
        group, before, store = self.group, list(self.group.members), self.group.ctx.store
        epoch = self.member.newer_epoch(group.patience_s)
        assert epoch is not None  # nothing stops the wait
        if epoch <= group.epoch:
            raise MembersLostError(f"rank {group.rank} (trainer): the lead formed no epoch "
                                   f"within {group.patience_s:g} s ({why})")
        members = self.member.acknowledge(epoch)
        if members is None and was_let_go(store, group.rank, epoch):
            raise LeftWhenAsked(f"rank {group.rank} (trainer): the lead, rank {group.lead}, let "
                                f"it go at its request (epoch {epoch} goes on without it)")
        if members is None:
            raise PeerLostError(f"rank {group.rank} (trainer): left out of epoch {epoch}")
        adopted = json.loads(store.get(group.keys.key(f"adopted/{epoch}")))
        group.register(epoch, members)
        group.adopt(adopted.get(str(group.rank), []))
        return [r for r in members if r not in before]


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
