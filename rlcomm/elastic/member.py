"""A member's side of a membership: it follows its leader from epoch to epoch, or, a new process
for a rank, asks to be admitted.

A member acknowledges each epoch its leader proposes (:meth:`Member.acknowledge`) and forms that
epoch's group with the others (:meth:`Member.enter`). One that was left out (it answered too
late, or its leader took it for lost) asks to join again; one whose leader was lost may be told
to follow another leader (:meth:`Member.move_to`).
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlcomm.elastic.epochs import (
    acknowledge,
    await_admission,
    build_epoch_group,
    latest_epoch,
    request_join,
)
from rlcomm.elastic.keys import Keys
from rlcomm.modes import Mode, ParallelMode

if TYPE_CHECKING:
    from rlcomm.context import CommContext

log = logging.getLogger(__name__)


class Member:
    """This rank's side of ``mode``'s group led by ``leader`` in the series ``space``.
    ``timeout``: each epoch group's; ``watch(epoch)``: whether a member declared that epoch's
    group broken."""

    def __init__(self, ctx: CommContext, mode: Mode, leader: int, timeout: datetime.timedelta,
                 space: str = "",
                 watch: Callable[[int], Callable[[], bool]] | None = None) -> None:
        self.ctx, self.mode, self.timeout, self.watch = ctx, mode, timeout, watch
        self.rank = ctx.get_global_rank()
        self.space = space
        self.leader, self.keys = leader, Keys(leader, space)
        self.epoch = 0
        self.members: list[int] = []  # the current epoch's group, leader first

    def enter(self, epoch: int, members: list[int]) -> None:
        """``epoch``'s group (``members``: leader first), formed and registered."""
        group = build_epoch_group(self.ctx.store, self.leader, epoch, members, self.rank,
                                  self.timeout, self.space)
        broken = self.watch(epoch) if self.watch is not None else None
        self.ctx.epochs.register(self.ctx, self.mode, group, members, broken=broken)
        self.epoch, self.members = epoch, list(members)

    def acknowledge(self, epoch: int) -> list[int] | None:
        """Acknowledges ``epoch`` and waits for the leader to settle it: its members (leader
        first), or None if this rank was left out."""
        return acknowledge(self.ctx.store, self.leader, epoch, self.rank, self.ctx.timeout,
                           self.space)

    def join(self, timeout_s: float, again: bool = True) -> list[int] | None:
        """Asks the leader to admit this process as its rank, and enters the epoch that admits
        it; returns its members, or None when it answered too late and ``again`` is False
        (else it asks again)."""
        beyond_plan = self.rank >= self.ctx.get_world_size(ParallelMode.GLOBAL)  # it grows the job
        while True:
            join = request_join(self.ctx.store, self.leader, self.rank, self.space, beyond_plan)
            log.info("rank %d (%s) asks rank %d to admit it", self.rank, socket.gethostname(),
                     self.leader)
            epoch, _ = await_admission(self.ctx.store, self.leader, join, timeout_s,
                                       space=self.space)
            members = self.acknowledge(epoch)
            if members is not None:
                self.enter(epoch, members)
                return members
            if not again:
                return None
            log.warning("rank %d: answered epoch %d too late; asking again", self.rank, epoch)

    def newer_epoch(self, timeout_s: float, poll_s: float = 0.01,
                    stopped: Callable[[], bool] | None = None) -> int | None:
        """Waits up to ``timeout_s`` for the leader to propose an epoch after this rank's;
        returns the newest epoch (this rank's own when none came in time: the caller tells),
        or None when ``stopped()`` says the series ended meanwhile."""
        deadline = time.monotonic() + timeout_s
        while (latest := latest_epoch(self.ctx.store, self.leader, self.space)) <= self.epoch:
            if stopped is not None and stopped():
                return None
            if time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        return latest

    def move_to(self, leader: int) -> None:
        """Follows ``leader`` from now on (its own was lost); it asks to join it next."""
        self.leader, self.keys = leader, Keys(leader, self.space)
        self.epoch = 0
