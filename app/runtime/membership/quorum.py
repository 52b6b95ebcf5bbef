"""The job's quorum of live members (``loop.min_rollouts``): how many the leaders need, whether a
lost one can still come back, and the leaders' wait for joiners below it
(app/runtime/membership/rollouts.py's ``EpochLeader.await_quorum``)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlcomm import CommContext, ParallelMode, collectives
from rlcomm.errors import MembersLostError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Quorum:
    """How many live members the job needs, how often a lost one is started again (None: by
    hand, at any time), and the names the messages give them."""

    min_members: int
    restarts: int | None
    members: str = "rollout ranks"
    leaders: str = "trainers"
    min_setting: str = "loop.min_rollouts"
    restarts_setting: str = "launcher.rollout_restarts"


def rejoinable(losses: list[int], live: list[int], quorum: Quorum) -> bool:
    """Whether a member a leader lost (``losses``: one entry per loss, replaced processes
    left out) can be replaced: always by hand (torchrun, srun); under the local launcher while
    the quorum's restarts are left for it."""
    count = Counter(losses)
    gone = [rank for rank in count if rank not in live]
    if quorum.restarts is None:
        return bool(gone)
    return any(count[rank] <= quorum.restarts for rank in gone)


class QuorumWait:
    """One wait of a leader below the quorum: announced once (the log, ``on_wait``: the
    progress line), bounded by ``patience_s``; it raises when no joiner can come, or past it."""

    def __init__(self, quorum: Quorum, patience_s: float, rank: int,
                 on_wait: Callable[[str], None] | None) -> None:
        self.quorum, self.patience_s, self.rank, self.on_wait = quorum, patience_s, rank, on_wait
        self.deadline: float | None = None

    def check(self, live: int, lost: str | None, joinable: bool) -> None:
        """``lost``: who this leader lost (None: none of its own; the others' groups lost them)."""
        q = self.quorum
        lost = lost or f"by the other {q.leaders}' groups"
        short = f"{live} live {q.members} of {q.min_setting}={q.min_members}"
        if not joinable:
            raise MembersLostError(f"{short}, and none can join ({q.restarts_setting}="
                                   f"{q.restarts}); lost: {lost}")
        if self.deadline is None:
            text = (f"waiting up to {self.patience_s:g} s for {q.members} to join: "
                    f"{live} live of {q.min_setting}={q.min_members}; lost: {lost}")
            log.warning("rank %d %s", self.rank, text)
            if self.on_wait is not None:
                self.on_wait(text)
            self.deadline = time.monotonic() + self.patience_s
        elif time.monotonic() > self.deadline:
            raise MembersLostError(f"{short} for {self.patience_s:g} s; lost: {lost}")


def job_counts(ctx: CommContext, leaders: ParallelMode, received: int,
               can_rejoin: bool) -> tuple[list[int], bool]:
    """Each leader's live members this update (``received``: this leader's), and whether a lost
    one can still come back to any leader (``can_rejoin``: to this one), over ``leaders``."""
    row = torch.tensor([[float(received), float(can_rejoin)]])
    everyone = collectives.all_gather(ctx, leaders, row).reshape(-1, 2)
    return [int(n) for n in everyone[:, 0].tolist()], bool(everyone[:, 1].max() > 0)
