"""The rollout ranks' membership: each trainer leads a group of rollout ranks, re-formed as
they leave and join (rlcomm.elastic's one membership; this module is the RL runtime's policy).

The leader (:class:`EpochLeader`, a trainer) drops a member whose transfer failed (at once when
its connection closes; when its link is down, after the epoch group's timeout,
rlcomm.elastic.patience_s). At an update boundary it admits the processes that asked to join;
any change forms the next epoch: the record goes in the store, the followers (the weight channel
and the segment route) end the old group (the members are told "moved" on it), the members
acknowledge the record, everyone builds the new group and the followers renew on it. Below the
:class:`~app.runtime.membership.quorum.Quorum` of live members in the whole job the leaders wait
that long for joiners, if one can come, then end the run naming who was lost. A member
(:class:`EpochMember`, a rollout rank) follows its leader to each new epoch, asks to be admitted
when it replaces a lost process, and goes to the trainer that takes it over when its own is lost
(app/runtime/membership/trainers.py).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from app.runtime.core import stopping
from app.runtime.membership.base import Follower, Transfer
from app.runtime.membership.quorum import Quorum, QuorumWait, job_counts, rejoinable
from rlcomm import CommContext, ParallelMode
from rlcomm.diagnostics.watchdog import default_hang_timeout
from rlcomm.elastic import (
    BEYOND_PLAN,
    Change,
    Join,
    Leader,
    Member,
    ask_to_leave,
    latest_epoch,
    moved,
    patience_s,
    was_let_go,
)
from rlcomm.net.gloo_words import describe_loss
from rlcomm.weights import TransfersEnded

log = logging.getLogger(__name__)
REPLACED = "replaced by a new process"
ASKED = "asked"  # a leave asked of the rank (SIGTERM to it alone, python -m app.leave)
# What a joining rollout rank's record adds: its first segment's version lag, and seconds from
# its admission to that segment trained.
JOIN_DETAILS = ("first_segment_lag", "first_trained_s")


def epoch_timeout(ctx: CommContext, timeout_s: float) -> datetime.timedelta:
    """Every epoch group's timeout (rlcomm.elastic.patience_s), from this rank's hang timeout
    (a joiner, without a watchdog, derives it as the others do from comm.timeout)."""
    hang = ctx.watchdog.hang_timeout if ctx.watchdog is not None else \
        default_hang_timeout(timeout_s)
    return datetime.timedelta(seconds=patience_s(timeout_s, hang))


class EpochLeader:
    """A leader's side (see the module's doc). ``mode``: the group the epochs are of;
    ``leaders``: the group of every leader of the job (they share counts and wait together)."""

    def __init__(self, ctx: CommContext, mode: ParallelMode, leaders: ParallelMode,
                 quorum: Quorum, hosts: dict[int, str], patience: datetime.timedelta,
                 planned: list[int], replacing: bool = False) -> None:
        self.ctx, self.leaders, self.quorum = ctx, leaders, quorum
        self.rank = ctx.get_global_rank()
        self.patience_s = patience.total_seconds()
        # ``replacing``: this process replaces a lost leader, whose members went to the other
        # leaders: it starts with none, on an epoch after its predecessor's.
        self.side = Leader(ctx, mode, planned, hosts, patience, replacing=replacing)
        self.dropped: dict[int, str] = {}  # lost since the current epoch formed
        self.counts: list[int] = []  # each leader's live members this update
        self.update = 0
        self.followers: list[Follower] = []
        self.on_wait: Callable[[str], None] | None = None  # the progress line, on rank 0

    @property
    def members(self) -> list[int]:
        return self.side.members

    @property
    def live(self) -> list[int]:
        """The members not lost since the epoch formed."""
        return [m for m in self.members if m not in self.dropped]

    @property
    def epoch(self) -> int:
        return self.side.epoch

    @property
    def changes(self) -> list[Change]:
        return self.side.changes

    def begin(self, followers: list[Follower]) -> None:
        self.followers = followers
        self.side.form()  # epoch 0
        for follower in followers:
            follower.begin(self.members)

    def _agree(self, changing: bool) -> bool:
        for follower in self.followers:
            changing = follower.agree(changing)
        return changing

    def sync(self, transfer: Transfer, first: bool) -> bool:
        """Admits joiners and drops the lost (a new epoch, whose first weights the followers
        send), else the next ``transfer``."""
        joins = self.side.pending_joins()
        self._let_go_those_asked()
        if self._agree(bool(joins or self.dropped)):
            self.change(joins)
        else:
            transfer(first)
        return True

    def _let_go_those_asked(self) -> None:
        """Members asked to leave go at this boundary, unless this trainer was asked to stop
        too: the whole job stops then (a SIGTERM to every rank), and they with it."""
        asked = self.side.pending_leaves()
        if stopping.asked():
            return
        for rank, reason in asked.items():
            if rank in self.live:
                self.side.let_go(rank)
                self.leave(rank, reason)

    def change(self, joins: list[Join]) -> None:
        """The next epoch: survivors and ``joins``, once they acknowledge it."""
        survivors, joining = self.live, []
        for join in joins:
            if join.rank in survivors:  # a new process for a rank we still count as live
                survivors.remove(join.rank)
                self.leave(join.rank, REPLACED)
                self.ctx.store.set(self.side.keys.replaced(join.rank), str(join.pid))
            if join.rank not in joining:
                joining.append(join.rank)
        # The record first: a member told "moved" reads it at once.
        epoch = self.side.propose(sorted(survivors + joining), joins)
        for follower in self.followers:
            follower.end(moved=True, epoch=epoch)
        tick = time.perf_counter()
        for rank in self.side.settle(self.patience_s):  # gone since, or cut off
            if rank in joining:
                joining.remove(rank)
            else:
                self.leave(rank, f"did not answer epoch {epoch} within {self.patience_s:g} s")
        self.side.form()
        beyond = {join.rank for join in joins if join.beyond_plan}
        for rank in joining:
            self._joined(rank, epoch, BEYOND_PLAN if rank in beyond else "admitted")
        self.dropped = {}
        for follower in self.followers:
            follower.renew(epoch, self.members)
        log.info("rank %d: epoch %d formed in %.3f s: members %s", self.rank, epoch,
                 time.perf_counter() - tick, self.members)

    def _joined(self, rank: int, epoch: int, reason: str) -> None:
        change = self.side.note("join", rank, reason, self.update, epoch)
        change.details = dict.fromkeys(JOIN_DETAILS)
        log.warning("rank %d (%s) joined rank %d's group: epoch %d, %d %s", rank, change.host,
                    self.rank, epoch, len(self.members), self.quorum.members)

    def leave(self, rank: int, reason: str) -> None:
        """``rank`` is lost (``reason``): dropped at the next boundary."""
        self.dropped[rank] = reason
        change = self.side.note("leave", rank, reason, self.update)
        log.warning("rank %d (%s) left rank %d's group (%s); %d %s go on", rank, change.host,
                    self.rank, reason, len(self.live), self.quorum.members)

    def adopt(self, ranks: list[int]) -> None:
        """``ranks``, members of a lost leader, may join this group (they ask to)."""
        self.side.admit(ranks)

    def first_segment(self, rank: int, lag: int) -> None:
        """A joiner's first data arrived, of this version lag."""
        for change in self.changes:
            if change.event == "join" and change.rank == rank and \
                    change.details.get("first_segment_lag") is None:
                change.details["first_segment_lag"] = lag

    def update_done(self) -> None:
        """After an update: the times to re-form (result.json's joins and leaves)."""
        now = time.time()
        self.side.changes.settled(now)
        for change in self.changes:
            details = change.details
            if details.get("first_segment_lag") is not None and \
                    details.get("first_trained_s") is None:
                details["first_trained_s"] = now - change.time

    def await_quorum(self, received: int, receive_more: Callable[[], int]) -> None:
        """Returns once the job has the quorum's live members (``received``: this leader's
        this update; ``receive_more``: after admitting joiners, how many more it heard from).
        Every leader takes part (so none waits alone in a collective of theirs, where it would
        be diagnosed as hung): those with joiners admit them, the others wait with them."""
        wait = QuorumWait(self.quorum, self.patience_s, self.rank, self.on_wait)
        while True:
            counts, joinable = job_counts(self.ctx, self.leaders, received, self._can_rejoin())
            live = sum(counts)
            if live >= self.quorum.min_members:
                self.counts = counts
                return
            wait.check(live, self.side.changes.lost(), joinable)
            joins = self.side.pending_joins()
            if self._agree(bool(joins)):
                self.change(joins)
                received += receive_more()
                continue
            time.sleep(0.05)

    def _can_rejoin(self) -> bool:
        """Whether a member this leader lost can still come back (a restart left, or a join by
        hand)."""
        losses = [c.rank for c in self.changes if c.event == "leave" and c.reason != REPLACED]
        return rejoinable(losses, self.live, self.quorum)

    def stop(self, updates: int, env_steps: int) -> None:
        """The job's counts go in the store (the members report them, and rank 0 collects the
        reports of the members listed there), then the followers end the group."""
        self.ctx.store.set(self.side.keys.stopped(), json.dumps(
            {"members": self.live, "updates": updates, "env_steps": env_steps}))
        for follower in self.followers:
            follower.end(moved=False, epoch=self.epoch)

    def result(self) -> dict[str, Any]:
        """Who left and joined this leader's group."""
        return {"epoch": self.epoch, "members": list(self.live),
                "changes": self.side.changes.records()}


class EpochMember:
    """A member's side: follows its leader to each new epoch; ``joining``: this process
    replaces a lost one and asks to be admitted."""

    def __init__(self, ctx: CommContext, mode: ParallelMode, leader: int, timeout_s: float,
                 joining: bool, patience: datetime.timedelta) -> None:
        self.ctx, self.mode = ctx, mode
        self.rank = ctx.get_global_rank()
        self.timeout_s, self.joining = timeout_s, joining
        self.side = Member(ctx, mode, leader, patience)
        # Lost with its group while sending, this rank followed its leader to a new epoch and
        # holds that epoch's first weights: the next sync has nothing to take.
        self.followed = False
        self.leaving = False  # it asked its leader to let it go
        self.left: str | None = None  # why this rank left while the run went on
        self.epochs_followed = 0
        self.final: dict[str, Any] = {}  # the job's counts at the stop (EpochLeader.stop)
        self.followers: list[Follower] = []
        self.on_wait: Callable[[str], None] | None = None  # a member waits for nobody

    @property
    def leader(self) -> int:
        return self.side.leader

    @property
    def epoch(self) -> int:
        return self.side.epoch

    def begin(self, followers: list[Follower]) -> None:
        self.followers = followers
        if self.joining:
            self._join()
            return
        planned = [self.leader, *[r for r in self.ctx.get_declared_ranks(self.mode)
                                  if r != self.leader]]
        self.side.enter(0, planned)
        for follower in followers:
            follower.begin(planned[1:])

    def sync(self, transfer: Transfer, first: bool) -> bool:
        """The next ``transfer``; False once the run stopped."""
        if self.followed:  # a new epoch's first weights came with following it
            self.followed = False
            return self.left is None
        if stopping.asked() and not self.leaving:
            self._ask_to_leave()
        try:
            transfer(first)
        except TransfersEnded as ended:
            if not ended.moved:
                self._end(moved=False)
                return self._stopped()
            return self._follow()
        except RuntimeError as err:  # gloo's error, or rlcomm's HangError around it
            return self.recover(err)
        return True

    def _ask_to_leave(self) -> None:
        """SIGTERM to this rank alone: its leader lets it go at its next update boundary (a
        SIGTERM to every rank stops the run there instead: the leader, asked too, keeps it)."""
        self.leaving = True
        ask_to_leave(self.ctx.store, self.rank, ASKED)
        log.warning("rank %d: asked to stop (%s); it leaves rank %d's group at its next update "
                    "boundary", self.rank, stopping.reason(), self.leader)

    def recover(self, err: BaseException) -> bool:
        """A transfer on this rank's group failed: follows its leader to its next epoch, or
        joins the leader that took it over when its own was lost (True), or learns the run
        stopped (False); re-raises if none of these."""
        outcome = self._after_failure(err)
        if isinstance(outcome, int) and not isinstance(outcome, bool):
            return self._move_to(outcome)
        return outcome and self._follow()

    def _move_to(self, leader: int) -> bool:
        """Its leader was lost and ``leader`` took this rank over: asks it to admit this rank."""
        log.warning("rank %d: its trainer, rank %d, was lost; rank %d takes it over", self.rank,
                    self.leader, leader)
        self._end(moved=True)
        self.side.move_to(leader)
        self.epochs_followed += 1
        self._join()
        return True

    def _end(self, moved: bool) -> None:
        for follower in self.followers:
            follower.end(moved=moved, epoch=self.epoch)

    def _join(self) -> None:
        members = self.side.join(self.timeout_s)
        assert members is not None  # it asks again until admitted
        self._entered(members)

    def _entered(self, members: list[int]) -> None:
        for follower in self.followers:
            follower.renew(self.epoch, members[1:])
        log.info("rank %d: in epoch %d of rank %d's group (members %s)", self.rank, self.epoch,
                 self.leader, members[1:])

    def _follow(self) -> bool:
        """The leader moved to a new epoch: go with it, or ask to join again if it has
        dropped this rank (it took it for lost); False if a newer process replaced this one."""
        self._end(moved=True)
        epoch = self.side.newer_epoch(self.timeout_s)
        self.epochs_followed += 1
        if self._replaced():
            return False
        assert epoch is not None  # nothing stops the wait
        members = self.side.acknowledge(epoch)
        if members is not None:
            self.side.enter(epoch, members)
            self._entered(members)
            return True
        if was_let_go(self.ctx.store, self.rank, epoch):
            self.left = ASKED
            log.warning("rank %d: rank %d let it go (epoch %d goes on without it); it ends",
                        self.rank, self.leader, epoch)
            return False
        self._join()
        return True

    def _replaced(self) -> bool:
        replaced = self.side.keys.replaced(self.rank)
        if not self.ctx.store.check([replaced]):
            return False
        newer = int(self.ctx.store.get(replaced))
        if newer == os.getpid():
            return False
        # The member of this rank is that process now.
        log.warning("rank %d (pid %d): replaced by a newer process (pid %d); stopping",
                    self.rank, os.getpid(), newer)
        return True

    def _after_failure(self, err: BaseException) -> bool | int:
        """gloo closes every connection of a group when one transfer on it times out, so a
        leader's wait for a member whose link went down ends its group with the survivors
        too, before it can tell them "moved" (and a survivor's own wait times out as the
        leader's does). Waits (up to ``comm.timeout``) for the leader to form a newer epoch
        (True: follow it) or to stop (False), or, where the leader was a trainer lost with
        elastic trainers, for the trainer that takes this rank over (its rank: join it);
        re-raises if none of these comes (it is lost), and at once once this rank was asked to
        stop: its update cannot end, and it holds nothing a checkpoint needs (the launcher's
        restart after a lost trainer stops every rank so, ``layout.elastic_trainers=false``)."""
        deadline = time.monotonic() + self.timeout_s
        store, keys = self.ctx.store, self.side.keys
        adopted = moved(self.rank)
        try:
            while latest_epoch(store, self.leader) <= self.epoch:
                if store.check([keys.stopped()]):  # the run stopped meanwhile
                    return self._stopped()
                if store.check([adopted]) and int(store.get(adopted)) != self.leader:
                    return int(store.get(adopted))
                if time.monotonic() > deadline or (stopping.asked() and not self.leaving):
                    raise err  # asked to stop (SIGTERM) with its leader gone: nothing to wait for
                time.sleep(0.05)
        except RuntimeError:  # the store is gone with the leader's host
            raise err from None
        log.warning("rank %d: its group with rank %d failed (%s); rank %d formed a new epoch: "
                    "following it", self.rank, self.leader, describe_loss(err), self.leader)
        return True

    def _stopped(self) -> bool:
        """The run stopped: the job's counts, as the leader left them in the store."""
        self.final = json.loads(self.ctx.store.get(self.side.keys.stopped()))
        return False

    def update_done(self) -> None:
        """A member times nothing: its leader records the joins and leaves."""

    def stop(self, updates: int, env_steps: int) -> None:
        """The leader stops the members, not the reverse."""

    def result(self) -> dict[str, Any]:
        """The job's counts, as its leader stopped at, like every rank reports them; this
        rank's epoch, and whether it joined a running job."""
        return {"updates": self.final.get("updates"), "env_steps": self.final.get("env_steps"),
                "epoch": self.epoch, "joined": self.joining, "left": self.left}
