"""Membership epochs (rlcomm.elastic): a leader's group re-formed as members leave and join.

The leader (:class:`EpochLeader`) drops a member whose transfer failed (at once when its
connection closes; when its link is down, after the epoch group's timeout,
rlcomm.elastic.patience_s). At an update boundary it admits the processes that asked to join
(rlcomm.elastic.request_join); any change forms the next epoch: the record goes in the store,
the followers end the old group (the members are told "moved" on it), the members acknowledge
the record, everyone builds the new group and the followers renew on it. Below the
:class:`Quorum` of live members in the whole job the leaders wait that long for joiners, if one
can come, then end the run naming who was lost. A member (:class:`EpochMember`) follows its
leader to each new epoch, or asks to be admitted when it replaces a lost process.

Which group the epochs are of (``mode``) and what the members are called are the caller's: the
members are acting ranks today; nothing here depends on it.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app.runtime.handoff.membership import Follower, Transfer
from app.runtime.handoff.quorum import Quorum, QuorumWait, rejoinable
from rlcomm import CommContext, ParallelMode, collectives
from rlcomm.diagnostics.watchdog import default_hang_timeout
from rlcomm.elastic import (
    Join,
    acknowledge,
    await_admission,
    build_epoch_group,
    describe_loss,
    latest_epoch,
    patience_s,
    request_join,
)
from rlcomm.elastic import Membership as EpochRecords
from rlcomm.weights import TransfersEnded

log = logging.getLogger(__name__)
REPLACED = "replaced by a new process"
# The leader that takes over a rollout rank whose trainer was lost (app/runtime/trainers/).
ADOPT = "elastic/adopt/{rank}"


def epoch_timeout(ctx: CommContext, timeout_s: float) -> datetime.timedelta:
    """Every epoch group's timeout (rlcomm.elastic.patience_s), from this rank's hang timeout
    (a joiner, without a watchdog, derives it as the others do from comm.timeout)."""
    hang = ctx.watchdog.hang_timeout if ctx.watchdog is not None else \
        default_hang_timeout(timeout_s)
    return datetime.timedelta(seconds=patience_s(timeout_s, hang))


@dataclass
class Change:
    """A join or a leave, for result.json."""

    event: str  # "join" | "leave"
    rank: int
    host: str
    reason: str
    epoch: int
    update: int
    time: float = field(default_factory=time.time)
    # Leave: seconds from it being noticed to the next update done with the survivors.
    # Join: its first segment's version lag, and seconds from admission to that segment trained.
    next_update_s: float | None = None
    first_segment_lag: int | None = None
    first_trained_s: float | None = None
    # A lost trainer's: the transitions of its own replay shard, lost with it (off-policy).
    lost_transitions: int | None = None

    def record(self) -> dict[str, Any]:
        record = {"event": self.event, "rank": self.rank, "host": self.host,
                  "reason": self.reason, "epoch": self.epoch, "update": self.update,
                  "time": round(self.time, 3)}
        if self.event == "leave":
            record["next_update_s"] = _rounded(self.next_update_s)
            if self.lost_transitions is not None:
                record["lost_transitions"] = self.lost_transitions
        else:
            record["first_segment_lag"] = self.first_segment_lag
            record["first_trained_s"] = _rounded(self.first_trained_s)
        return record


def _rounded(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


class EpochLeader:
    """A leader's side (see the module's doc). ``mode``: the group the epochs are of;
    ``leaders``: the group of every leader of the job (they share counts and wait together)."""

    def __init__(self, ctx: CommContext, mode: ParallelMode, leaders: ParallelMode,
                 quorum: Quorum, hosts: dict[int, str], patience: datetime.timedelta,
                 planned: list[int], replacing: bool = False) -> None:
        self.ctx, self.mode, self.leaders, self.quorum = ctx, mode, leaders, quorum
        self.rank = ctx.get_global_rank()
        self.patience, self.patience_s = patience, patience.total_seconds()
        self.hosts = dict(hosts)  # rank -> host, as last known
        # ``replacing``: this process replaces a lost leader, whose members went to the other
        # leaders: it starts with none, on an epoch after its predecessor's.
        first = latest_epoch(ctx.store, self.rank) + 1 if replacing else 0
        self.records = EpochRecords(ctx.store, self.rank, planned, epoch=first,
                                    members=[] if replacing else None)
        self.changes: list[Change] = []
        self.dropped: dict[int, str] = {}  # lost since the current epoch formed
        self.counts: list[int] = []  # each leader's live members this update
        self.update = 0
        self.followers: list[Follower] = []
        self.on_wait: Callable[[str], None] | None = None  # the progress line, on rank 0

    @property
    def members(self) -> list[int]:
        return self.records.members

    @property
    def live(self) -> list[int]:
        """The members not lost since the epoch formed."""
        return [m for m in self.members if m not in self.dropped]

    @property
    def epoch(self) -> int:
        return self.records.epoch

    def begin(self, followers: list[Follower]) -> None:
        self.followers = followers
        self._register()  # epoch 0
        for follower in followers:
            follower.begin(self.members)

    def _register(self) -> None:
        group = self.records.group(self.rank, self.patience)
        self.ctx.register_epoch_group(self.mode, group, [self.rank, *self.members])

    def _agree(self, changing: bool) -> bool:
        for follower in self.followers:
            changing = follower.agree(changing)
        return changing

    def sync(self, transfer: Transfer, first: bool) -> bool:
        """Admits joiners and drops the lost (a new epoch, whose first weights the followers
        send), else the next ``transfer``."""
        joins = self.records.pending_joins()
        if self._agree(bool(joins or self.dropped)):
            self.change(joins)
        else:
            transfer(first)
        return True

    def change(self, joins: list[Join]) -> None:
        """The next epoch: survivors and ``joins``, once they acknowledge it."""
        survivors, joining = self.live, []
        for join in joins:
            if join.rank in survivors:  # a new process for a rank we still count as live
                survivors.remove(join.rank)
                self.leave(join.rank, REPLACED)
                self.ctx.store.set(f"elastic/{self.rank}/replaced/{join.rank}", str(join.pid))
            if join.rank not in joining:
                joining.append(join.rank)
            self.hosts[join.rank] = join.host
        # The record first: a member told "moved" reads it at once.
        epoch = self.records.announce(sorted(survivors + joining), joins)
        for follower in self.followers:
            follower.end(moved=True, epoch=epoch)
        tick = time.perf_counter()
        for rank in self.records.confirm(self.patience_s):  # gone since, or cut off
            if rank in joining:
                joining.remove(rank)
            else:
                self.leave(rank, f"did not answer epoch {epoch} within {self.patience_s:g} s")
        self._register()
        for rank in joining:
            self._joined(rank, epoch)
        self.dropped = {}
        for follower in self.followers:
            follower.renew(epoch, self.members)
        log.info("rank %d: epoch %d formed in %.3f s: members %s", self.rank, epoch,
                 time.perf_counter() - tick, self.members)

    def _joined(self, rank: int, epoch: int) -> None:
        host = self.hosts.get(rank, "?")
        self.changes.append(Change("join", rank, host, "admitted", epoch, self.update))
        log.warning("rank %d (%s) joined rank %d's group: epoch %d, %d %s", rank, host,
                    self.rank, epoch, len(self.members), self.quorum.members)

    def leave(self, rank: int, reason: str) -> None:
        """``rank`` is lost (``reason``): dropped at the next boundary."""
        self.dropped[rank] = reason
        host = self.hosts.get(rank, "?")
        self.changes.append(Change("leave", rank, host, reason, self.epoch, self.update))
        log.warning("rank %d (%s) left rank %d's group (%s); %d %s go on", rank, host,
                    self.rank, reason, len(self.live), self.quorum.members)

    def adopt(self, ranks: list[int]) -> None:
        """``ranks``, members of a lost leader, may join this group (they ask to)."""
        self.records.planned += [r for r in ranks if r not in self.records.planned]

    def first_segment(self, rank: int, lag: int) -> None:
        """A joiner's first data arrived, of this version lag."""
        for change in self.changes:
            if change.event == "join" and change.rank == rank and change.first_segment_lag is None:
                change.first_segment_lag = lag

    def update_done(self) -> None:
        """After an update: the times to re-form (result.json's joins and leaves)."""
        now = time.time()
        for change in self.changes:
            if change.event == "leave" and change.next_update_s is None:
                change.next_update_s = now - change.time
            elif change.first_segment_lag is not None and change.first_trained_s is None:
                change.first_trained_s = now - change.time

    def await_quorum(self, received: int, receive_more: Callable[[], int]) -> None:
        """Returns once the job has the quorum's live members (``received``: this leader's
        this update; ``receive_more``: after admitting joiners, how many more it heard from).
        Every leader takes part (so none waits alone in a collective of theirs, where it would
        be diagnosed as hung): those with joiners admit them, the others wait with them."""
        wait = QuorumWait(self.quorum, self.patience_s, self.rank, self.on_wait)
        while True:
            counts, joinable = self._job_counts(received)
            live = sum(counts)
            if live >= self.quorum.min_members:
                self.counts = counts
                return
            wait.check(live, self._lost(), joinable)
            joins = self.records.pending_joins()
            if self._agree(bool(joins)):
                self.change(joins)
                received += receive_more()
                continue
            time.sleep(0.05)

    def _lost(self) -> str:
        return ", ".join(f"rank {c.rank} on {c.host} ({c.reason})"
                         for c in self.changes if c.event == "leave") or \
            f"by the other {self.quorum.leaders}' groups"

    def _job_counts(self, received: int) -> tuple[list[int], bool]:
        """Each leader's live members this update, and whether a lost one can still come
        back to any leader (a restart left, or a join by hand)."""
        row = torch.tensor([[float(received), float(self._can_rejoin())]])
        everyone = collectives.all_gather(self.ctx, self.leaders, row).reshape(-1, 2)
        return [int(n) for n in everyone[:, 0].tolist()], bool(everyone[:, 1].max() > 0)

    def _can_rejoin(self) -> bool:
        losses = [c.rank for c in self.changes if c.event == "leave" and c.reason != REPLACED]
        return rejoinable(losses, self.live, self.quorum)

    def stop(self, updates: int, env_steps: int) -> None:
        """The job's counts go in the store (the members report them, and rank 0 collects the
        reports of the members listed there), then the followers end the group."""
        self.ctx.store.set(f"elastic/{self.rank}/final", json.dumps(
            {"members": self.live, "updates": updates, "env_steps": env_steps}))
        for follower in self.followers:
            follower.end(moved=False, epoch=self.epoch)

    def result(self) -> dict[str, Any]:
        """Who left and joined this leader's group."""
        return {"epoch": self.epoch, "members": list(self.live),
                "changes": [c.record() for c in self.changes]}


class EpochMember:
    """A member's side: follows its leader to each new epoch; ``joining``: this process
    replaces a lost one and asks to be admitted."""

    def __init__(self, ctx: CommContext, mode: ParallelMode, leader: int, timeout_s: float,
                 joining: bool, patience: datetime.timedelta) -> None:
        self.ctx, self.mode, self.leader = ctx, mode, leader
        self.rank = ctx.get_global_rank()
        self.timeout_s, self.joining, self.patience = timeout_s, joining, patience
        self.epoch = 0
        # Lost with its group while sending, this rank followed its leader to a new epoch and
        # holds that epoch's first weights: the next sync has nothing to take.
        self.followed = False
        self.epochs_followed = 0
        self.final: dict[str, Any] = {}  # the job's counts at the stop (EpochLeader.stop)
        self.followers: list[Follower] = []
        self.on_wait: Callable[[str], None] | None = None  # a member waits for nobody

    def begin(self, followers: list[Follower]) -> None:
        self.followers = followers
        if self.joining:
            self._join()
            return
        planned = [self.leader, *[r for r in self.ctx.get_declared_ranks(self.mode)
                                  if r != self.leader]]
        group = build_epoch_group(self.ctx.store, self.leader, 0, planned, self.rank,
                                  self.patience)
        self.ctx.register_epoch_group(self.mode, group, planned)
        for follower in followers:
            follower.begin(planned[1:])

    def sync(self, transfer: Transfer, first: bool) -> bool:
        """The next ``transfer``; False once the run stopped."""
        if self.followed:  # a new epoch's first weights came with following it
            self.followed = False
            return True
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
        self.leader = leader
        self.epochs_followed += 1
        self._join()
        return True

    def _end(self, moved: bool) -> None:
        for follower in self.followers:
            follower.end(moved=moved, epoch=self.epoch)

    def _join(self) -> None:
        while True:
            join = request_join(self.ctx.store, self.leader, self.rank)
            log.info("rank %d (%s) asks rank %d to admit it", self.rank, socket.gethostname(),
                     self.leader)
            epoch, _ = await_admission(self.ctx.store, self.leader, join, self.timeout_s)
            members = acknowledge(self.ctx.store, self.leader, epoch, self.rank,
                                  self.ctx.timeout)
            if members is not None:
                self._enter(epoch, members)
                return
            log.warning("rank %d: answered epoch %d too late; asking again", self.rank, epoch)

    def _enter(self, epoch: int, members: list[int]) -> None:
        group = build_epoch_group(self.ctx.store, self.leader, epoch, members, self.rank,
                                  self.patience)
        self.ctx.register_epoch_group(self.mode, group, members)
        self.epoch = epoch
        for follower in self.followers:
            follower.renew(epoch, members[1:])
        log.info("rank %d: in epoch %d of rank %d's group (members %s)", self.rank, epoch,
                 self.leader, members[1:])

    def _follow(self) -> bool:
        """The leader moved to a new epoch: go with it, or ask to join again if it has
        dropped this rank (it took it for lost); False if a newer process replaced this one."""
        self._end(moved=True)
        epoch = latest_epoch(self.ctx.store, self.leader)
        deadline = time.monotonic() + self.timeout_s
        while epoch <= self.epoch and time.monotonic() < deadline:  # not written yet
            time.sleep(0.01)
            epoch = latest_epoch(self.ctx.store, self.leader)
        self.epochs_followed += 1
        if self._replaced():
            return False
        members = acknowledge(self.ctx.store, self.leader, epoch, self.rank, self.ctx.timeout)
        if members is not None:
            self._enter(epoch, members)
            return True
        self._join()
        return True

    def _replaced(self) -> bool:
        replaced = f"elastic/{self.leader}/replaced/{self.rank}"
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
        re-raises if none of these comes (it is lost)."""
        deadline = time.monotonic() + self.timeout_s
        store, prefix = self.ctx.store, f"elastic/{self.leader}/"
        adopted = ADOPT.format(rank=self.rank)
        try:
            while latest_epoch(store, self.leader) <= self.epoch:
                if store.check([prefix + "final"]):  # the run stopped meanwhile
                    return self._stopped()
                if store.check([adopted]) and int(store.get(adopted)) != self.leader:
                    return int(store.get(adopted))
                if time.monotonic() > deadline:
                    raise err
                time.sleep(0.05)
        except RuntimeError:  # the store is gone with the leader's host
            raise err from None
        log.warning("rank %d: its group with rank %d failed (%s); rank %d formed a new epoch: "
                    "following it", self.rank, self.leader, describe_loss(err), self.leader)
        return True

    def _stopped(self) -> bool:
        """The run stopped: the job's counts, as the leader left them in the store."""
        self.final = json.loads(self.ctx.store.get(f"elastic/{self.leader}/final"))
        return False

    def update_done(self) -> None:
        """A member times nothing: its leader records the joins and leaves."""

    def stop(self, updates: int, env_steps: int) -> None:
        """The leader stops the members, not the reverse."""

    def result(self) -> dict[str, Any]:
        """The job's counts, as its leader stopped at, like every rank reports them; this
        rank's epoch, and whether it joined a running job."""
        return {"updates": self.final.get("updates"), "env_steps": self.final.get("env_steps"),
                "epoch": self.epoch, "joined": self.joining}
