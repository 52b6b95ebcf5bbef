"""What moves between ranks in one update, and the time each rank spends blocked on it.

Over WEIGHT_TRANSFER a trainer gathers one packed segment per rollout rank (bytes of a fixed
layout, tagged with the weights version it was collected with: app/runtime/segments.py) and
sends the weights back (zero-copy, from the bound agent: the acting module and the normalisers'
statistics); over GLOBAL every rank learns every finished episode, so all stop at the same
update. With a colocated layout (no rollout ranks) only the episodes move.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from app.runtime.algorithm import Segment
from app.runtime.segments import Layout
from app.runtime.worker import Episode, as_segment
from rlcomm import CommContext, LayoutPlan, ParallelMode, collectives
from rlcomm.weights import WeightReceiver, WeightSender

WT, GLOBAL = ParallelMode.WEIGHT_TRANSFER, ParallelMode.GLOBAL


class StaleDataError(RuntimeError):
    """A trainer was handed a segment older than ``loop.max_staleness`` allows."""


def check_staleness(
    versions: list[tuple[int, int]], current: int, max_staleness: int, update: int
) -> list[int]:
    """Each segment's version lag behind ``current`` (the weights about to be trained) from its
    ``(rank, version)``; a lag beyond ``max_staleness`` (or a version from the future) raises,
    so such data is never trained on."""
    lags = [current - version for _, version in versions]
    for (rank, version), lag in zip(versions, lags):
        if not 0 <= lag <= max_staleness:
            raise StaleDataError(
                f"update {update}: rank {rank}'s segment was collected with weights version "
                f"{version}, {lag} behind version {current} (loop.max_staleness={max_staleness})"
            )
    return lags


def policy_receiver(ctx: CommContext, policy: torch.nn.Module) -> WeightReceiver:
    """The rollout side of WEIGHT_TRANSFER: it accepts exactly ``policy``'s names, shapes and
    dtypes (anything else is an error naming the tensor, on both sides, before data moves)."""
    return WeightReceiver(ctx, WT, expected=policy.state_dict())


class Exchange:
    """One rank's side of the hand-off: segments, weights and episodes, with the time it spent
    blocked and the bytes it sent.

    Built before DDP wraps ``policy``: a trainer binds it to its send buffer (the parameters
    then live there, and DDP and the optimizer hold the same Parameter objects as ever), a
    rollout rank to its receiver (loads point the policy at the received bytes).
    """

    def __init__(
        self,
        ctx: CommContext,
        plan: LayoutPlan,
        policy: torch.nn.Module,
        layout: Layout,  # of one packed segment
        episode_cap: int,  # finished episodes one rank shares per update, at most
        max_staleness: int,
        verify_every: int,
    ) -> None:
        self.ctx = ctx
        self.rank = ctx.get_global_rank()
        self.is_trainer = self.rank in plan.trainers
        self.split = not plan.colocated
        self.layout, self.episode_cap, self.max_staleness = layout, episode_cap, max_staleness
        self.sender: WeightSender | None = None
        self.receiver: WeightReceiver | None = None
        if self.split and self.is_trainer:
            self.sender = WeightSender(ctx, WT, verify_every=verify_every)
            self.sender.bind(policy)
        elif self.split:
            self.receiver = policy_receiver(ctx, policy)
            self.receiver.bind(policy)
        self.transfer_s = 0.0  # trainers: sending weights
        self.wait_s = 0.0  # this update's time blocked in the trainer <-> rollout hand-off
        self.wait_total_s = 0.0
        # Payload this rank sent to other ranks (weights by a trainer, trajectories by a rollout
        # rank), so a run can be checked against what the network carried.
        self.weight_bytes = sum(t.nbytes for t in policy.state_dict().values())
        self.weight_bytes_sent = 0
        self.trajectory_bytes_sent = 0
        self.staleness: dict[int, int] = {}  # version lag -> segments trained on (trainers)
        self.acting_version = 0  # the weights version the policy holds (rollouts)

    def version(self, updates: int) -> int:
        """The weights version this rank acts (rollouts) or trains (trainers) with; colocated,
        where nothing is sent, the number of updates done."""
        if self.sender is not None:
            return self.sender.version
        if self.receiver is not None:
            return self.acting_version
        return updates

    def sync_weights(self, policy: torch.nn.Module, first: bool) -> None:
        """Trainers send the weights the next segment will be trained with; rollouts take the
        newest weights that have arrived, waiting only as long as ``max_staleness`` requires.

        The first transfer (it carries the layout) is complete on both sides when this returns.
        Later sends are launched without waiting (the trainer waits before its next optimizer
        step, which rewrites the bound send buffer); on the group they are issued, like the
        rollouts' posted receives, between one segment's gather and the next, so every member
        issues the same operations in the same order.
        """
        tick = time.perf_counter()
        if self.sender is not None:
            self.sender.send(policy, wait=first)  # bound: no state dict, no copy
            self.transfer_s += time.perf_counter() - tick
            receivers = len(self.ctx.get_ranks_in_group(WT)) - 1
            self.weight_bytes_sent += receivers * self.weight_bytes
        elif self.receiver is not None:
            if first or self.max_staleness == 0:
                # Lockstep: the policy is idle until these weights arrive, so they land in the
                # bytes it acts with (no second buffer, nothing to swap).
                self.acting_version = self.receiver.receive_into(policy)
            else:
                self.receiver.post()
                # The trainer will train the next segment with the version just posted.
                newest = self.receiver.version + self.receiver.posted
                while self.receiver.version < newest - self.max_staleness:
                    self.receiver.receive()  # completes the oldest posted receive
                # A segment boundary: swap in the newest version that has arrived.
                self.acting_version = self.receiver.load(policy)
            self.wait_s += time.perf_counter() - tick

    def before_optimizer_step(self) -> None:
        """A trainer's last send must be complete: the optimizer rewrites the bytes being sent."""
        if self.sender is not None:
            tick = time.perf_counter()
            self.sender.wait()
            self.transfer_s += time.perf_counter() - tick

    def gather_segments(self, own: torch.Tensor | None, updates: int) -> list[Segment]:
        """Split layouts: the segments the trainer trains on next, each with its version lag (a
        rollout rank gets none). ``own``: this rollout rank's packed segment; ``updates``: the
        number done so far."""
        packed = own if own is not None else self.layout.empty()
        trainer = self.ctx.get_declared_ranks(WT)[0]
        tick = time.perf_counter()
        gathered = collectives.gather(self.ctx, WT, packed, dst=trainer)
        if self.rank != trainer:
            self.trajectory_bytes_sent += packed.nbytes
        self.wait_s += time.perf_counter() - tick
        if gathered is None:
            return []
        members = self.ctx.get_ranks_in_group(WT)
        segments = [(r, as_segment(self.layout, t)) for r, t in zip(members, gathered)
                    if r != trainer]
        versions = [(r, s.version) for r, s in segments]
        lags = check_staleness(versions, self.version(updates), self.max_staleness, updates + 1)
        for (_, segment), lag in zip(segments, lags):
            segment.lag = lag
            self.staleness[lag] = self.staleness.get(lag, 0) + 1
        return [segment for _, segment in segments]

    def share_episodes(
        self, mine: list[Episode], lag: int
    ) -> tuple[list[Episode], dict[str, float]]:
        """Everyone learns every finished episode, so all ranks stop at the same update; the
        same message carries each rank's waiting time and its data's version lag."""
        packed = torch.full((self.episode_cap + 2, 2), float("nan"))
        kept = mine[-self.episode_cap :]
        packed[0] = torch.tensor([len(kept), float(self.is_trainer)])
        packed[1] = torch.tensor([self.wait_s, lag])
        if kept:
            packed[2 : len(kept) + 2] = torch.tensor(kept, dtype=torch.float32)
        everyone = collectives.all_gather(self.ctx, GLOBAL, packed.unsqueeze(0))
        self.wait_total_s += self.wait_s
        self.wait_s = 0.0
        episodes = []
        waits: dict[bool, list[float]] = {True: [], False: []}
        for block in everyone:
            count, trainer = int(block[0, 0].item()), bool(block[0, 1].item())
            waits[trainer].append(float(block[1, 0]))
            episodes += [(float(r), int(n)) for r, n in block[2 : count + 2].tolist()]
        shared = {
            "staleness": float(everyone[:, 1, 1].max()),
            "trainer_wait_s": float(np.mean(waits[True])),
            "rollout_wait_s": float(np.mean(waits[False])) if waits[False] else 0.0,
        }
        return episodes, shared
