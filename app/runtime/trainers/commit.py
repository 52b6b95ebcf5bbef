"""Every call over the trainers' group completes on every live trainer, or fails on all of them
(replica groups of sharded trainers, ``layout.trainer_replicas``; docs/failures.md).

gloo can complete a collective for some members that a lost member broke for the others. An
unsharded trainer that went on one call ahead fails on its next call over the group and joins the
recovery there. A sharded trainer cannot: its next call may be a tensor-parallel collective
(DTensor's, in the forward pass) with a peer of its replica group that waits in the recovery, and
the two would wait for each other. So with replica groups each call is committed through the
rendezvous store before any trainer goes on (``rlcomm.recovery``'s ``commit_with``): every
trainer marks it done, and waits until every member of the epoch has, or until the group is
declared broken (then the call counts as failed here too, and every trainer recovers at the same
call). A member that neither marks it nor lives (its process on this host ended, or its heartbeat
stood still for ``BEAT_LOST_S``) is declared lost here.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch.distributed as dist

from app.runtime.trainers.liveness import Liveness
from rlcomm.errors import GroupBrokenError

POLL = datetime.timedelta(seconds=0.2)


class CallCommit:
    """One trainer's side: ``commit()`` after each call over the trainers' group of ``epoch()``
    with ``members()``; ``key(name)``: the trainers' store keys; ``reset()`` at each epoch."""

    def __init__(self, store: dist.Store, key: Callable[[str], str], rank: int,
                 liveness: Liveness, epoch: Callable[[], int],
                 members: Callable[[], list[int]]) -> None:
        self.store, self.key, self.rank, self.liveness = store, key, rank, liveness
        self.epoch, self.members = epoch, members
        self.calls = 0  # this epoch's calls so far

    def reset(self) -> None:
        self.calls = 0

    def commit(self) -> None:
        self.calls += 1
        epoch, store = self.epoch(), self.store
        done = f"done/{epoch}/{self.calls}/"
        store.set(self.key(done + str(self.rank)), "1")
        keys = {rank: self.key(done + str(rank)) for rank in self.members()}
        broken = self.key(f"broken/{epoch}")
        gone: Callable[[list[int]], list[int]] | None = None
        while True:
            try:
                store.wait(list(keys.values()), POLL)
                return
            except RuntimeError:  # the poll's timeout (DistStoreError)
                pass
            if store.check([broken]):
                raise GroupBrokenError(f"a call over the trainers' group (epoch {epoch}, call "
                                       f"{self.calls}) did not complete on every trainer")
            waiting = [r for r, k in keys.items() if not store.check([k])]
            gone = gone or self.liveness.watch(waiting)
            lost = gone(waiting)
            if lost and not store.check([broken]):
                store.set(broken, f"rank(s) {lost} left during call {self.calls} (the "
                          "process ended, or its heartbeat stood still)")
