"""Membership epochs: rollout ranks that leave and join a running job, nobody restarted.

An elastic group has a *leader* (a trainer: static, its process, state and TRAIN_DATA_PARALLEL
group stay) and *members* (rollout ranks) that come and go. Each membership is an *epoch*: the
planned group is epoch 0; every later one is a new ``ProcessGroupGloo`` among the leader and the
live members, built over a store prefix of its own (``PrefixStore``), as torchft reconfigures its
groups, with public torch APIs only. gloo groups cannot shrink or abort (pytorch#130345), so a
group that lost a member is left as it is, its works kept alive (:data:`graveyard`), and the next
epoch's group replaces it in the :class:`~rlcomm.CommContext`, validated like a planned group.

Inside an epoch the leader talks to each member point to point (segments in, weights out,
``rlcomm.weights`` on an elastic group), so a lost member fails only its own transfers: a killed
process at once (its connections close), a lost link after the group's timeout.

The store is the side channel (keys under ``elastic/<leader>/``): ``joins`` counts join requests
(``join/<n>``: rank, host, pid); ``epoch/<e>`` lists an epoch's members, leader first, written by
the leader before anyone builds its group; ``latest`` is the newest epoch; ``admit/<rank>/<pid>``
tells a joining process its epoch.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import distributed as dist

from rlcomm.errors import MembershipError
from rlcomm.net.gloo_words import describe_loss

TRAINER_SPACE = "trainers/"  # the trainers' own epochs (elastic trainers), under their lead
SEGMENT_TAG = 1  # point-to-point tag of member -> leader data (weights use rlcomm.weights' own)

# What a lost member leaves behind: its epoch's group and the works still posted on it. gloo
# cannot abort them and destroying a group with pending work can hang, so they live as long as
# the process (which ends without tearing them down: os._exit, app/launch).
graveyard: list[Any] = []


_RUNNING = "elastic/running"


def mark_running(store: dist.Store) -> None:
    """Rank 0, once every planned group exists: a process that starts as a rank of this job
    from now on replaces a lost one and joins (:func:`is_running`)."""
    store.set(_RUNNING, "1")


def is_running(store: dist.Store) -> bool:
    return bool(store.check([_RUNNING]))


@dataclass(frozen=True)
class Join:
    """A process asking to join ``leader``'s group as ``rank``."""

    rank: int
    host: str
    pid: int


def _prefix(leader: int, space: str = "") -> str:
    return f"elastic/{leader}/{space}"


def build_epoch_group(
    store: dist.Store, leader: int, epoch: int, members: list[int], rank: int,
    timeout: datetime.timedelta, space: str = "",
) -> dist.ProcessGroup:
    """This rank's group of ``epoch`` (``members``, leader first, in group-rank order), over the
    epoch's own store prefix; validated: every member must hold the same epoch and list.
    ``space``: another series of groups the same leader leads (its own epochs, prefixes)."""
    prefix = dist.PrefixStore(f"{_prefix(leader, space)}epoch{epoch}/", store)
    position = members.index(rank)
    digest = _digest(members)
    seen = torch.zeros(len(members), 3, dtype=torch.int64)  # each member fills its own row
    seen[position] = torch.tensor([epoch, rank, digest])
    try:
        group = cast(dist.ProcessGroup,
                     dist.ProcessGroupGloo(prefix, position, len(members), timeout))
        group.allreduce([seen]).wait()
    except RuntimeError as err:  # DistStoreError too: a member missing, or of another epoch
        raise MembershipError(
            f"rank {rank}: epoch {epoch} of rank {leader}'s group should be ranks {members}; "
            f"it did not form within {timeout.total_seconds():g} s: a member is missing or "
            f"holds another epoch or member list ({describe_loss(err)})") from err
    found = [(int(e), int(r)) for e, r, _ in seen.tolist()]
    others = [int(r) for e, r, d in seen.tolist() if (e, d) != (epoch, digest)]
    if found != [(epoch, r) for r in members] or others:
        disagree = f"; rank(s) {', '.join(map(str, others))} hold another member list" \
            if others else ""
        raise MembershipError(
            f"rank {rank}: epoch {epoch} of rank {leader}'s group should be ranks {members}; "
            f"its members report (epoch, rank) {found}{disagree}"
        )
    return group


def _digest(members: list[int]) -> int:
    return zlib.crc32(json.dumps(members).encode())  # the same in every process; fits int64


class Membership:
    """The leader's side: who is in its group, and the store records of every change.
    ``space``: a series of groups of its own that the same leader leads (keys and prefixes
    under ``elastic/<leader>/<space>``); ``members``: the first epoch's, if not the planned."""

    def __init__(self, store: dist.Store, leader: int, planned: list[int], epoch: int = 0,
                 space: str = "", members: list[int] | None = None) -> None:
        self.store, self.leader, self.space = store, leader, space
        self.planned = list(planned)  # the layout's group: who may join
        self.members = [r for r in (planned if members is None else members) if r != leader]
        self.epoch = epoch
        # Every join request of this job's store counts: one may come before this exists.
        self._joins_seen = 0
        first = json.dumps([leader, *self.members])
        store.set(_prefix(leader, space) + f"epoch/{epoch}", first)
        # Fixed as it starts: a member of a lost predecessor that reads it is told it is out
        # (acknowledge: None) and asks to join.
        store.set(_prefix(leader, space) + f"final/{epoch}", first)
        store.set(_prefix(leader, space) + "latest", str(epoch))

    def pending_joins(self) -> list[Join]:
        """Join requests that arrived since the last call (one store round trip when none)."""
        count = int(self.store.add(_prefix(self.leader, self.space) + "joins", 0))
        found = []
        for n in range(self._joins_seen, count):
            record = json.loads(self.store.get(_prefix(self.leader, self.space) + f"join/{n}"))
            if record["rank"] in self.planned and record["rank"] != self.leader:
                found.append(Join(int(record["rank"]), str(record["host"]), int(record["pid"])))
        self._joins_seen = count
        return found

    def announce(self, members: list[int], joins: list[Join]) -> int:
        """Proposes the next epoch with ``members`` (leader excluded): its record goes in the
        store, and each joiner is told it; returns the epoch. The members acknowledge it
        (:func:`acknowledge`) and :meth:`confirm` settles who is in."""
        self.epoch += 1
        self.members = list(members)
        record = _prefix(self.leader, self.space) + f"epoch/{self.epoch}"
        self.store.set(record, json.dumps([self.leader, *self.members]))
        self.store.set(_prefix(self.leader, self.space) + "latest", str(self.epoch))
        for join in joins:
            self.store.set(_prefix(self.leader, self.space) + f"admit/{join.rank}/{join.pid}", str(self.epoch))
        return self.epoch

    def confirm(self, timeout_s: float, poll_s: float = 0.005,
                gone: Callable[[list[int]], list[int]] | None = None,
                along: Callable[[list[int]], list[int]] | None = None) -> list[int]:
        """Waits up to ``timeout_s`` for every proposed member's acknowledgement, then fixes the
        epoch's members to those that gave it (``final/<e>``); returns the ones that did not
        (gone since, or cut off: the group would wait for them in vain). ``gone(waiting)``:
        those of the members still waited for known to be gone (no need to wait longer).
        ``along(missing)``: members that leave with the missing ones although they answered
        (returned too; an acknowledging one then reads that it is out)."""
        keys = {r: _prefix(self.leader, self.space) + f"ack/{self.epoch}/{r}" for r in self.members}
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = [r for r, k in keys.items() if not self.store.check([k])]
            if not waiting or time.monotonic() > deadline:
                break
            if gone is not None and set(gone(waiting)) == set(waiting):
                break
            time.sleep(poll_s)
        missing = [r for r, k in keys.items() if not self.store.check([k])]
        if along is not None and missing:
            missing += [r for r in along(missing) if r in self.members and r not in missing]
        self.members = [r for r in self.members if r not in missing]
        self.store.set(_prefix(self.leader, self.space) + f"final/{self.epoch}",
                       json.dumps([self.leader, *self.members]))
        return missing

    def group(self, rank: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
        return build_epoch_group(self.store, self.leader, self.epoch,
                                 [self.leader, *self.members], rank, timeout, self.space)


def acknowledge(store: dist.Store, leader: int, epoch: int, rank: int,
                timeout: datetime.timedelta, space: str = "") -> list[int] | None:
    """A member's answer to a proposed epoch: it acknowledges and waits for the leader to fix
    the members; returns them (leader first), or None if it was left out (too late)."""
    store.set(_prefix(leader, space) + f"ack/{epoch}/{rank}", "1")
    final = _prefix(leader, space) + f"final/{epoch}"
    store.wait([final], timeout)
    members = [int(r) for r in json.loads(store.get(final))]
    return members if rank in members else None


def request_join(store: dist.Store, leader: int, rank: int, space: str = "") -> Join:
    """A new process asks ``leader`` to admit it as ``rank`` at its next update boundary."""
    join = Join(rank, socket.gethostname(), os.getpid())
    n = int(store.add(_prefix(leader, space) + "joins", 1)) - 1
    store.set(_prefix(leader, space) + f"join/{n}", json.dumps(join.__dict__))
    return join


def await_admission(store: dist.Store, leader: int, join: Join, timeout_s: float,
                    poll_s: float = 0.05, space: str = "") -> tuple[int, list[int]]:
    """Waits until ``leader`` admits ``join``; returns its epoch and the proposed members
    (leader first), which it then :func:`acknowledge` s."""
    key = _prefix(leader, space) + f"admit/{join.rank}/{join.pid}"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise MembershipError(
                f"rank {join.rank}: rank {leader} did not admit it within {timeout_s:g} s"
            )
        time.sleep(poll_s)
    epoch = int(store.get(key))
    return epoch, epoch_members(store, leader, epoch, space)


def epoch_members(store: dist.Store, leader: int, epoch: int, space: str = "") -> list[int]:
    return [int(r) for r in json.loads(store.get(_prefix(leader, space) + f"epoch/{epoch}"))]


def close_membership(store: dist.Store, leader: int, members: list[int], space: str) -> None:
    """The run ended with ``members`` (leader first) in ``leader``'s ``space``."""
    store.set(_prefix(leader, space) + "closed", json.dumps(members))


def closing_members(store: dist.Store, leader: int, space: str) -> list[int] | None:
    """The members :func:`close_membership` left, or None before it."""
    key = _prefix(leader, space) + "closed"
    return [int(r) for r in json.loads(store.get(key))] if store.check([key]) else None


def latest_epoch(store: dist.Store, leader: int, space: str = "") -> int:
    return int(store.get(_prefix(leader, space) + "latest"))


def send_to_leader(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    group.send([tensor], 0, SEGMENT_TAG).wait()


def receive_from_members(
    group: dist.ProcessGroup, buffers: dict[int, torch.Tensor], positions: dict[int, int]
) -> dict[int, str]:
    """Receives one tensor from each member (``buffers``: rank -> where it lands; ``positions``:
    rank -> its group rank); returns the members that failed, with why (a closed connection at
    once, silence after the group's timeout: :func:`patience_s`)."""
    works: dict[int, dist.Work] = {}
    lost: dict[int, str] = {}
    for rank in buffers:
        try:
            works[rank] = group.recv([buffers[rank]], positions[rank], SEGMENT_TAG)
        except RuntimeError as err:  # its connection closed before: gloo raises at once
            lost[rank] = describe_loss(err)
    for rank, work in works.items():
        try:
            work.wait()
        except Exception as err:
            lost[rank] = describe_loss(err)
    return lost


def patience_s(timeout_s: float, hang_timeout_s: float) -> float:
    """The timeout of every epoch's group: how long a member may be silent (or a leader wait
    for members) before it counts as lost. Within the job's timeout, and short of its hang
    diagnosis (rlcomm.diagnostics.watchdog), which would otherwise take the ranks waiting
    meanwhile in a collective of theirs for hung."""
    return 0.8 * min(timeout_s, hang_timeout_s)


def drain(group: dist.ProcessGroup, positions: list[int], nbytes: int, count: int) -> None:
    """Posts ``count`` receives per member for what it may still send on a group the leader
    leaves (its sends then complete), and keeps them alive unread."""
    for position in positions:
        for _ in range(count):
            scratch = torch.empty(nbytes, dtype=torch.uint8)
            try:
                graveyard.append((scratch, group.recv([scratch], position, SEGMENT_TAG)))
            except RuntimeError:  # that member is gone too
                break


