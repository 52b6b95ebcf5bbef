"""Elastic rollout ranks (``layout.elastic_rollouts``, the default): the hand-off of a split
layout when rollout ranks may leave and join (rlcomm.elastic's membership epochs).

A trainer leads its WEIGHT_TRANSFER group. Per update it receives one segment from each live
member, point to point: a member whose transfer fails is dropped (at once when its connection
closes; when its link is down, after the epoch group's timeout, rlcomm.elastic.patience_s) and
what it had in flight is discarded and counted; training goes on with the others. At the update
boundary it admits the processes that asked to join (rlcomm.elastic.request_join); any change
forms the next epoch: the survivors are told on the old group (rlcomm.weights' "moved" header),
the members acknowledge it in the store, everyone builds the new group, and the first weights
on it are verified by checksum. Below ``loop.min_rollouts`` members it waits that long for
joiners (the other trainers with it), then ends the run naming who was lost.

Nothing in the steady state spans every rank: a member's finished episodes and waiting time
travel in its segment, the trainers share them over TRAIN_DATA_PARALLEL and take the stop
decision there, and the stop reaches the members as the last header on their group.
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

from app.runtime.algorithm import Segment
from app.runtime.exchange import check_staleness, policy_receiver
from app.runtime.segments import EPISODE_FIELDS, Layout, pack_episodes, unpack_episodes
from app.runtime.worker import Episode, as_segment
from rlcomm import CommContext, ParallelMode, collectives
from rlcomm.diagnostics.watchdog import default_hang_timeout
from rlcomm.elastic import (
    Join,
    Membership,
    MembersLostError,
    acknowledge,
    await_admission,
    build_epoch_group,
    describe_loss,
    drain,
    graveyard,
    latest_epoch,
    patience_s,
    receive_from_members,
    request_join,
    send_to_leader,
)
from rlcomm.weights import TransfersEnded, WeightReceiver, WeightSender

WT, TDP = ParallelMode.WEIGHT_TRANSFER, ParallelMode.TRAIN_DATA_PARALLEL
log = logging.getLogger(__name__)


def segment_fields(layout: Layout, packed: torch.Tensor) -> Segment:
    """The segment an update sees (views into ``packed``), without the episode fields."""
    segment = as_segment(layout, packed)
    for name in EPISODE_FIELDS:
        segment.pop(name, None)
    return segment


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

    def record(self) -> dict[str, Any]:
        record = {"event": self.event, "rank": self.rank, "host": self.host,
                  "reason": self.reason, "epoch": self.epoch, "update": self.update,
                  "time": round(self.time, 3)}
        if self.event == "leave":
            record["next_update_s"] = _rounded(self.next_update_s)
        else:
            record["first_segment_lag"] = self.first_segment_lag
            record["first_trained_s"] = _rounded(self.first_trained_s)
        return record


def _rounded(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


class LeaderExchange:
    """A trainer's side of an elastic hand-off (see the module's doc)."""

    def __init__(self, ctx: CommContext, agent: torch.nn.Module, layout: Layout,
                 max_staleness: int, verify_every: int, min_rollouts: int, timeout_s: float,
                 hosts: dict[int, str]) -> None:
        self.ctx, self.agent, self.layout = ctx, agent, layout
        self.rank = ctx.get_global_rank()
        self.max_staleness, self.verify_every = max_staleness, verify_every
        self.min_rollouts, self.timeout_s = min_rollouts, timeout_s
        self.patience = epoch_timeout(ctx, timeout_s)
        self.patience_s = self.patience.total_seconds()
        self.hosts = dict(hosts)  # rank -> host, as last known
        planned = ctx.get_declared_ranks(WT)
        self.membership = Membership(ctx.store, self.rank, planned)
        self._register(self.membership.group(self.rank, self.patience))  # epoch 0
        self.sender = WeightSender(ctx, WT, verify_every=verify_every)
        self.sender.bind(agent)
        self.changes: list[Change] = []
        self.dropped: dict[int, str] = {}  # lost since the current epoch formed
        self.discarded = 0  # segments lost with their member, or left behind by an epoch change
        self.transfer_s = self.wait_s = self.wait_total_s = 0.0
        self.weight_bytes = sum(t.nbytes for t in agent.state_dict().values())
        self.weight_bytes_sent = 0
        self.trajectory_bytes_sent = 0
        self.staleness: dict[int, int] = {}
        self.update = 0
        self.on_wait: Callable[[str], None] | None = None  # the progress line, on rank 0

    @property
    def members(self) -> list[int]:
        return self.membership.members

    @property
    def live(self) -> list[int]:
        """The members not lost since the epoch formed."""
        return [m for m in self.members if m not in self.dropped]

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    def version(self, updates: int) -> int:
        return self.sender.version

    def _register(self, group: Any) -> None:
        self.ctx.register_epoch_group(WT, group, [self.rank, *self.members])

    # ---- the update boundary ------------------------------------------------------------

    def sync_weights(self, policy: torch.nn.Module, first: bool) -> None:
        """Admits joiners and drops the lost (a new epoch), then sends the next weights."""
        tick = time.perf_counter()
        joins = self.membership.pending_joins()
        if joins or self.dropped:
            self._next_epoch(joins)
        else:
            self.sender.send(policy, wait=first)
            self.weight_bytes_sent += len(self.members) * self.weight_bytes
        self.transfer_s += time.perf_counter() - tick

    def before_optimizer_step(self) -> None:
        tick = time.perf_counter()
        try:
            self.sender.wait()
        except Exception:  # a member lost while its weights were in flight: dropped next
            graveyard.append(self.sender.abandon())
        self.transfer_s += time.perf_counter() - tick

    def _next_epoch(self, joins: list[Join]) -> None:
        old_group = self.ctx.get_group(WT)
        positions = {m: i + 1 for i, m in enumerate(self.members)}
        survivors = [m for m in self.members if m not in self.dropped]
        joining = []
        for join in joins:
            if join.rank in survivors:  # a new process for a rank we still count as live
                survivors.remove(join.rank)
                self._leave(join.rank, "replaced by a new process")
                self.ctx.store.set(f"elastic/{self.rank}/replaced/{join.rank}", str(join.pid))
            if join.rank not in joining:
                joining.append(join.rank)
            self.hosts[join.rank] = join.host
        members = sorted(survivors + joining)
        # The record first: a survivor told "moved" reads it at once.
        epoch = self.membership.announce(members, joins)
        graveyard.append((self.sender, old_group, self.sender.end(moved=True)))
        if self.max_staleness:  # what the members sent ahead on the old group
            drain(old_group, list(positions.values()), self.layout.nbytes,
                  self.max_staleness + 1)
        tick = time.perf_counter()
        for rank in self.membership.confirm(self.patience_s):  # gone since, or cut off
            if rank in joining:
                joining.remove(rank)
            else:
                self._leave(rank, f"did not answer epoch {epoch} within {self.patience_s:g} s")
        members = list(self.members)
        self._register(self.membership.group(self.rank, self.patience))
        for rank in joining:
            self.changes.append(Change("join", rank, self.hosts.get(rank, "?"),
                                       "admitted", epoch, self.update))
            log.warning("rank %d (%s) joined rank %d's group: epoch %d, %d rollout ranks",
                        rank, self.hosts.get(rank, "?"), self.rank, epoch, len(members))
        self.dropped = {}
        version = self.sender.version
        self.sender = WeightSender(self.ctx, WT, verify_every=self.verify_every,
                                   first_version=version)
        self.sender.bind(self.agent)
        # Every member (a joiner above all) starts from these, verified whatever
        # loop.verify_weights_every says.
        self.sender.send(self.agent, wait=True, verify=True)
        self.weight_bytes_sent += len(self.members) * self.weight_bytes
        log.info("rank %d: epoch %d formed in %.3f s: members %s", self.rank, epoch,
                 time.perf_counter() - tick, members)

    def update_done(self) -> None:
        """After an update: the times to re-form (result.json's joins and leaves)."""
        now = time.time()
        for change in self.changes:
            if change.event == "leave" and change.next_update_s is None:
                change.next_update_s = now - change.time
            elif change.first_segment_lag is not None and change.first_trained_s is None:
                change.first_trained_s = now - change.time

    def _leave(self, rank: int, reason: str) -> None:
        self.dropped[rank] = reason
        self.changes.append(Change("leave", rank, self.hosts.get(rank, "?"), reason,
                                   self.epoch, self.update))
        log.warning("rank %d (%s) left rank %d's group (%s); %d rollout ranks go on",
                    rank, self.hosts.get(rank, "?"), self.rank, reason,
                    len([m for m in self.members if m not in self.dropped]))

    # ---- segments -----------------------------------------------------------------------

    def gather_segments(self, updates: int) -> tuple[list[Segment], list[Episode], float]:
        """This update's segments from the live members, their episodes and mean waiting time;
        below ``min_rollouts`` members, waits for joiners first (up to ``comm.timeout``)."""
        self.update = updates
        tick = time.perf_counter()
        received = self._receive()
        # Every trainer takes part, so none waits alone in a collective of theirs (where it
        # would be diagnosed as hung): the short ones admit joiners, the others wait with them.
        deadline: float | None = None
        while self._short_anywhere(len(received) < self.min_rollouts):
            if len(received) < self.min_rollouts:
                lost = ", ".join(f"rank {c.rank} on {c.host} ({c.reason})"
                                 for c in self.changes if c.event == "leave")
                if deadline is None:
                    deadline = time.monotonic() + self.patience_s
                    text = (f"waiting up to {self.patience_s:g} s for rollout ranks to join: "
                            f"{len(received)} live of loop.min_rollouts={self.min_rollouts}; "
                            f"lost: {lost}")
                    log.warning("rank %d %s", self.rank, text)
                    if self.on_wait is not None:
                        self.on_wait(text)
                if time.monotonic() > deadline:
                    raise MembersLostError(
                        f"{len(received)} live rollout ranks of "
                        f"loop.min_rollouts={self.min_rollouts} for {self.patience_s:g} s; "
                        f"lost: {lost}")
                joins = self.membership.pending_joins()
                if joins:
                    self._next_epoch(joins)
                    received += self._receive()
                    continue
            time.sleep(0.05)
        self.wait_s += time.perf_counter() - tick
        segments, episodes, waits = [], [], []
        versions = []
        for rank, packed in received:
            new, wait = unpack_episodes(self.layout, packed)
            episodes += new
            waits.append(wait)
            segment = segment_fields(self.layout, packed)
            segments.append(segment)
            versions.append((rank, segment.version))
        lags = check_staleness(versions, self.sender.version, self.max_staleness, updates + 1)
        for segment, lag in zip(segments, lags):
            segment.lag = lag
            self.staleness[lag] = self.staleness.get(lag, 0) + 1
        for (rank, _), lag in zip(versions, lags):
            for change in self.changes:
                if change.event == "join" and change.rank == rank and \
                        change.first_segment_lag is None:
                    change.first_segment_lag = lag
        return segments, episodes, (sum(waits) / len(waits) if waits else 0.0)

    def _short_anywhere(self, short: bool) -> bool:
        """Whether any trainer has fewer live rollout ranks than ``loop.min_rollouts``."""
        flag = torch.tensor([float(short)])
        return bool(collectives.all_reduce(self.ctx, TDP, flag, torch.distributed.ReduceOp.MAX)
                    .item())

    def _receive(self) -> list[tuple[int, torch.Tensor]]:
        live = [m for m in self.members if m not in self.dropped]
        positions = {m: i + 1 for i, m in enumerate(self.members)}
        buffers = {m: self.layout.empty() for m in live}
        lost = receive_from_members(self.ctx.get_group(WT), buffers,
                                    {m: positions[m] for m in live})
        for rank, reason in lost.items():
            self.discarded += 1
            self._leave(rank, reason)
        return [(m, buffers[m]) for m in live if m not in lost]

    def stop(self, updates: int, env_steps: int) -> None:
        """The run stopped: the job's counts go in the store (the members report them, and rank
        0 collects the reports of the members listed there), then the members are told, and
        what they sent ahead is taken off them."""
        group = self.ctx.get_group(WT)
        live = [i + 1 for i, m in enumerate(self.members) if m not in self.dropped]
        self.ctx.store.set(f"elastic/{self.rank}/final", json.dumps(
            {"members": self.live, "updates": updates, "env_steps": env_steps}))
        graveyard.append((self.sender, self.sender.end(moved=False)))
        drain(group, live, self.layout.nbytes, self.max_staleness + 1)


def epoch_timeout(ctx: CommContext, timeout_s: float) -> datetime.timedelta:
    """Every epoch group's timeout (rlcomm.elastic.patience_s), from this rank's hang timeout
    (a joiner, without a watchdog, derives it as the others do from comm.timeout)."""
    hang = ctx.watchdog.hang_timeout if ctx.watchdog is not None else \
        default_hang_timeout(timeout_s)
    return datetime.timedelta(seconds=patience_s(timeout_s, hang))


class MemberExchange:
    """A rollout rank's side: send segments to its trainer, take the weights it sends, follow it
    to each new epoch; ``joining``: this process replaces a lost one and asks to be admitted."""

    def __init__(self, ctx: CommContext, agent: torch.nn.Module, layout: Layout,
                 leader: int, max_staleness: int, timeout_s: float, joining: bool) -> None:
        self.ctx, self.agent, self.layout = ctx, agent, layout
        self.rank = ctx.get_global_rank()
        self.leader, self.max_staleness, self.timeout_s = leader, max_staleness, timeout_s
        self.wait_s = self.wait_total_s = 0.0
        self.trajectory_bytes_sent = 0
        self.acting_version = 0
        self.epochs_followed = 0
        self.final: dict[str, Any] = {}  # the job's counts at the stop (LeaderExchange.stop)
        self.receiver: WeightReceiver
        self.patience = epoch_timeout(ctx, timeout_s)
        if joining:
            self._join()
        else:  # epoch 0: the planned group's members
            planned = [leader, *[r for r in ctx.get_declared_ranks(WT) if r != leader]]
            group = build_epoch_group(ctx.store, leader, 0, planned, self.rank, self.patience)
            ctx.register_epoch_group(WT, group, planned)
            self.epoch = 0
            self.receiver = policy_receiver(ctx, agent)
            self.receiver.bind(agent)

    def version(self, updates: int) -> int:
        return self.acting_version

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
        self.ctx.register_epoch_group(WT, group, members)
        self.epoch = epoch
        self.receiver = policy_receiver(self.ctx, self.agent)
        self.receiver.bind(self.agent)
        # The first transfer on a group: complete before acting, verified by its checksums.
        self.acting_version = self.receiver.receive_into(self.agent)
        log.info("rank %d: in epoch %d of rank %d's group (members %s), weights version %d",
                 self.rank, epoch, self.leader, members[1:], self.acting_version)

    def _follow(self) -> bool:
        """The trainer moved to a new epoch: go with it, or ask to join again if it has
        dropped this rank (it took it for lost); False if a newer process replaced this one."""
        graveyard.append((self.receiver, self.ctx.get_group(WT), self.receiver.abandon()))
        epoch = latest_epoch(self.ctx.store, self.leader)
        deadline = time.monotonic() + self.timeout_s
        while epoch <= self.epoch and time.monotonic() < deadline:  # not written yet
            time.sleep(0.01)
            epoch = latest_epoch(self.ctx.store, self.leader)
        self.epochs_followed += 1
        replaced = f"elastic/{self.leader}/replaced/{self.rank}"
        if self.ctx.store.check([replaced]):
            newer = int(self.ctx.store.get(replaced))
            if newer != os.getpid():  # the member of this rank is that process now
                log.warning("rank %d (pid %d): replaced by a newer process (pid %d); stopping",
                            self.rank, os.getpid(), newer)
                return False
        members = acknowledge(self.ctx.store, self.leader, epoch, self.rank, self.ctx.timeout)
        if members is not None:
            self._enter(epoch, members)
            return True
        self._join()
        return True

    def _after_failure(self, err: BaseException) -> bool:
        """A transfer on this rank's group failed. gloo closes every connection of a group when
        one transfer on it times out, so a trainer's wait for a member whose link went down ends
        its group with the survivors too, before it can tell them "moved" (and a survivor's own
        wait times out as the trainer's does). Waits (up to ``comm.timeout``) for the trainer to
        form a newer epoch (True: follow it) or to stop (False); re-raises if it does neither
        (the trainer is lost)."""
        deadline = time.monotonic() + self.timeout_s
        store, prefix = self.ctx.store, f"elastic/{self.leader}/"
        try:
            while latest_epoch(store, self.leader) <= self.epoch:
                if store.check([prefix + "final"]):  # the run stopped meanwhile
                    return self._stopped()
                if time.monotonic() > deadline:
                    raise err
                time.sleep(0.05)
        except RuntimeError:  # the store is gone with the trainer's host
            raise err from None
        log.warning("rank %d: its group with rank %d failed (%s); rank %d formed a new epoch: "
                    "following it", self.rank, self.leader, describe_loss(err), self.leader)
        return True

    def _stopped(self) -> bool:
        """The run stopped: the job's counts, as the trainer left them in the store."""
        self.final = json.loads(self.ctx.store.get(f"elastic/{self.leader}/final"))
        return False

    def send_segment(self, packed: torch.Tensor, episodes: list[Episode]) -> bool | None:
        """Sends this segment; None if it was sent, else whether to go on (it was lost with the
        group: True when this rank followed its trainer to a new epoch and holds its weights,
        False when the run stopped)."""
        pack_episodes(self.layout, packed, episodes, self.wait_s)
        self.wait_total_s += self.wait_s
        self.wait_s = 0.0
        tick = time.perf_counter()
        try:
            send_to_leader(self.ctx.get_group(WT), packed)
        except RuntimeError as err:
            going = self._after_failure(err) and self._follow()
            self.wait_s += time.perf_counter() - tick
            return going
        self.trajectory_bytes_sent += packed.nbytes
        self.wait_s += time.perf_counter() - tick
        return None

    def sync_weights(self, first: bool) -> bool:
        """Takes the next weights (as the static exchange does); False once the run stopped."""
        tick = time.perf_counter()
        try:
            if first:
                if self.acting_version == 0:
                    self.acting_version = self.receiver.receive_into(self.agent)
            elif self.max_staleness == 0:
                # Beside the weights acted with, not in place: the trainer's last message (stop,
                # or moved to a new epoch) carries no version and must not overwrite them.
                self.receiver.receive()
                self.acting_version = self.receiver.load(self.agent)
            else:
                self.receiver.post()
                newest = self.receiver.version + self.receiver.posted
                while self.receiver.version < newest - self.max_staleness:
                    self.receiver.receive()
                self.acting_version = self.receiver.load(self.agent)
        except TransfersEnded as ended:
            if not ended.moved:
                graveyard.append((self.receiver, self.receiver.abandon()))
                return self._stopped()
            return self._follow()
        except RuntimeError as err:  # gloo's error, or rlcomm's HangError around it
            return self._after_failure(err) and self._follow()
        finally:
            self.wait_s += time.perf_counter() - tick
        return True
