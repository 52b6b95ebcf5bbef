"""Loops that hang or mismatch on purpose, for tests/e2e/test_hangs.py (``loop._target_=...``).

Each is bounded: whatever it waits for, it gives up after ``max_wait_s`` so that a test that
fails cannot leave processes behind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from rlcomm import CommContext, collectives


def _sleep(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)  # rank sleeps here


@dataclass
class Hang:
    """Every rank runs five INTRA_NODE all_reduces (a mode the app itself does not use, so the
    sequence numbers are the loop's own); ``rank`` does ``fault`` at ``step`` instead:

    - ``sleep``: sits in its own code for ``max_wait_s`` (never enters the collective);
    - ``slow``: sits in its own code for ``max_wait_s``, then joins the collective (no hang);
    - ``skip``: skips that collective, then waits in WEIGHT_TRANSFER;
    - ``broadcast``: calls broadcast where the others call all_reduce (same sequence number);
    - ``shape``: calls all_reduce with a different shape;
    - ``deadlock``: rank 0 waits in TRAIN_DATA_PARALLEL for ``rank``, which is in INTRA_NODE.
    """

    fault: str = "sleep"
    rank: int = 2
    step: int = 3
    max_wait_s: float = 120.0
    mode: str = "INTRA_NODE"  # the mode of the common steps (GLOBAL spans the hosts of a 2x2 run)

    def __call__(self, ctx: CommContext, job: Any) -> dict[str, Any]:
        for step in range(1, 6):
            if step == self.step and job.rank == self.rank:
                self._fault(ctx)
            elif step == self.step and self.fault == "deadlock" and job.rank == 0:
                collectives.all_reduce(ctx, "TRAIN_DATA_PARALLEL", torch.ones(2))  # TDP wait
            else:
                if step == self.step and self.fault == "deadlock":
                    _sleep(2.0)  # rank 0 is stuck first: that is where the hang starts
                collectives.all_reduce(ctx, self.mode, torch.ones(4))  # everyone's step
        return {"steps": 5}

    def _fault(self, ctx: CommContext) -> None:
        if self.fault == "sleep":
            _sleep(self.max_wait_s)
        elif self.fault == "slow":
            _sleep(self.max_wait_s)
            collectives.all_reduce(ctx, "INTRA_NODE", torch.ones(4))
        elif self.fault == "skip":
            _sleep(2.0)  # the others are stuck first: that is where the hang starts
            collectives.broadcast(ctx, "WEIGHT_TRANSFER", torch.ones(8))  # skipper waits
        elif self.fault == "broadcast":
            collectives.broadcast(ctx, "INTRA_NODE", torch.ones(4), src=0)  # wrong op
        elif self.fault == "shape":
            collectives.all_reduce(ctx, "INTRA_NODE", torch.ones(8))  # wrong shape
        elif self.fault == "deadlock":
            _sleep(2.0)
            collectives.all_reduce(ctx, "INTRA_NODE", torch.ones(4))  # the partner waits
        else:
            raise ValueError(f"unknown fault {self.fault!r}")
