"""Inside an epoch the leader talks to each member point to point, so a lost member fails only
its own transfers: a killed process at once (its connections close), a lost link after the
group's timeout (:func:`patience_s`). gloo groups cannot shrink or abort (pytorch#130345): what
a lost member leaves behind is kept alive (:data:`graveyard`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import distributed as dist

from rlcomm.net.gloo_words import describe_loss

SEGMENT_TAG = 1  # point-to-point tag of member -> leader data (weights use rlcomm.weights' own)

# What a lost member leaves behind: its epoch's group and the works still posted on it. gloo
# cannot abort them and destroying a group with pending work can hang, so they live as long as
# the process (which ends without tearing them down: os._exit, app/launch).
graveyard: list[Any] = []


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
