"""Every call over an epoch's group completes on every live member, or fails on all of them.

gloo can complete a collective for some members that a lost member broke for the others. A
member that went on one call ahead fails on its next call over the group and joins the recovery
there, unless its next call is over another group with a peer that waits in the recovery (a
tensor-parallel collective of sharded trainers in replica groups, docs/failures.md): then the
two wait for each other. So each call is committed through the rendezvous store before any
member goes on (``rlcomm.recovery``'s ``commit_with``): every member marks it done, and waits
until every member of the epoch has, or until the group is declared broken (then the call counts
as failed here too, and every member recovers at the same call). A member that neither marks it
nor lives (its process on this host ended, or its heartbeat stood still for ``BEAT_LOST_S``:
rlcomm/elastic/liveness.py) is declared lost here.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch.distributed as dist

from rlcomm.elastic.keys import Keys
from rlcomm.elastic.liveness import Liveness
from rlcomm.errors import GroupBrokenError

POLL = datetime.timedelta(seconds=0.2)


class CallCommit:
    """One member's side: ``commit()`` after each call over the group of ``epoch()`` with
    ``members()``; ``keys``: the series' store keys; ``reset()`` at each epoch."""

    def __init__(self, store: dist.Store, keys: Keys, rank: int,
                 liveness: Liveness, epoch: Callable[[], int],
                 members: Callable[[], list[int]]) -> None:
        self.store, self.keys, self.rank, self.liveness = store, keys, rank, liveness
        self.epoch, self.members = epoch, members
        self.calls = 0  # this epoch's calls so far

    def reset(self) -> None:
        self.calls = 0

    def commit(self) -> None:
        self.calls += 1
        epoch, store = self.epoch(), self.store
        store.set(self.keys.done(epoch, self.calls, self.rank), "1")
        keys = {rank: self.keys.done(epoch, self.calls, rank) for rank in self.members()}
        broken = self.keys.broken(epoch)
        gone: Callable[[list[int]], list[int]] | None = None
        while True:
            try:
                store.wait(list(keys.values()), POLL)
                return
            except RuntimeError:  # the poll's timeout (DistStoreError)
                pass
            if store.check([broken]):
                raise GroupBrokenError(f"a call over the group of epoch {epoch} (call "
                                       f"{self.calls}) did not complete on every member")
            waiting = [r for r, k in keys.items() if not store.check([k])]
            gone = gone or self.liveness.watch(waiting)
            lost = gone(waiting)
            if lost and not store.check([broken]):
                store.set(broken, f"rank(s) {lost} left during call {self.calls} (the "
                          "process ended, or its heartbeat stood still)")
