"""A leader's side of a membership: its group's members, epoch after epoch, over the store.

The leader proposes each epoch (its members, and the processes it admits), waits for the
members to acknowledge it, settles the epoch with those that did, and forms the epoch's group,
which replaces the mode's group in its context (``CommContext.epochs``). Every join and leave
is recorded (:class:`~rlcomm.elastic.changes.Changes`). What a change means to the job (who
takes a lost member's work, what a joiner heals from) is its users' policy: this side knows
members, leaders and groups.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlcomm.elastic.changes import Change, Changes
from rlcomm.elastic.epochs import EpochRecords, Join, build_epoch_group, latest_epoch
from rlcomm.elastic.keys import Keys
from rlcomm.modes import Mode

if TYPE_CHECKING:
    from rlcomm.context import CommContext

Gone = Callable[[list[int]], list[int]]  # those of the waited-for members known to be gone


class Leader:
    """The leader of ``mode``'s group (this rank) in the series ``space``. ``planned``: who may
    join; ``hosts``: rank -> host, as last known; ``timeout``: each epoch group's;
    ``replacing``: this process replaces a lost leader, whose members went elsewhere: it starts
    with none, on an epoch after its predecessor's; ``members``: the first epoch's (default: the
    planned); ``watch(epoch)``: whether a member declared that epoch's group broken."""

    def __init__(self, ctx: CommContext, mode: Mode, planned: list[int], hosts: dict[int, str],
                 timeout: datetime.timedelta, space: str = "", replacing: bool = False,
                 members: list[int] | None = None,
                 watch: Callable[[int], Callable[[], bool]] | None = None) -> None:
        self.ctx, self.mode, self.timeout, self.watch = ctx, mode, timeout, watch
        self.rank = ctx.get_global_rank()
        self.keys = Keys(self.rank, space)
        self.hosts = dict(hosts)
        # A leader beyond the plan has no predecessor: its series starts at 0.
        replaced = replacing and ctx.store.check([self.keys.latest()])
        first = latest_epoch(ctx.store, self.rank, space) + 1 if replaced else 0
        self.records = EpochRecords(ctx.store, self.rank, planned, epoch=first, space=space,
                                    members=[] if replacing else members)
        self.changes = Changes()

    @property
    def members(self) -> list[int]:
        """The current epoch's members, the leader left out."""
        return self.records.members

    @property
    def epoch(self) -> int:
        return self.records.epoch

    @property
    def group_ranks(self) -> list[int]:
        """The current epoch's group, leader first."""
        return [self.rank, *self.members]

    def form(self) -> None:
        """The current epoch's group, formed with its members and registered."""
        group = build_epoch_group(self.ctx.store, self.rank, self.epoch, self.group_ranks,
                                  self.rank, self.timeout, self.keys.space)
        broken = self.watch(self.epoch) if self.watch is not None else None
        self.ctx.epochs.register(self.ctx, self.mode, group, self.group_ranks, broken=broken)

    def pending_joins(self) -> list[Join]:
        """Join requests that arrived since the last call, from ranks that may join."""
        return self.records.pending_joins()

    def pending_leaves(self) -> dict[int, str]:
        """Leave requests for this group's members since the last call: rank -> reason."""
        return self.records.pending_leaves()

    def let_go(self, rank: int) -> None:
        """``rank`` leaves at its request: the next epoch is the first without it, and the
        member, left out of it, ends instead of asking to join again."""
        self.records.let_go(rank)

    def propose(self, members: list[int], joins: list[Join]) -> int:
        """The next epoch with ``members`` (the leader left out), its record in the store, and
        each joiner told it; returns the epoch."""
        for join in joins:
            self.hosts[join.rank] = join.host
        return self.records.announce(members, joins)

    def settle(self, patience_s: float, gone: Gone | None = None,
               along: Gone | None = None) -> list[int]:
        """Waits up to ``patience_s`` for the proposed members' acknowledgements, fixes the
        epoch's members to those that gave them, and returns the others (gone since, or cut
        off). ``gone``: those known to be gone (no need to wait longer); ``along``: members
        that leave with the missing ones although they answered."""
        return self.records.confirm(patience_s, gone=gone, along=along)

    def admit(self, ranks: list[int]) -> None:
        """``ranks`` may join this group from now on (they ask to)."""
        self.records.planned += [r for r in ranks if r not in self.records.planned]

    def note(self, event: str, rank: int, reason: str, step: int,
             epoch: int | None = None) -> Change:
        """A join or a leave, recorded."""
        return self.changes.note(event, rank, self.hosts.get(rank, "?"), reason,
                                 self.epoch if epoch is None else epoch, step)
