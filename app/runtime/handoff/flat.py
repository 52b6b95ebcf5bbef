"""The flat hand-off of a static layout: whole weights, one broadcast per trainer.

Over WEIGHT_TRANSFER a trainer gathers one packed segment per rollout rank (bytes of a fixed
segment format, tagged with the weights version it was collected with: app/runtime/segments.py) and
sends the weights back (zero-copy, from the bound agent: the acting module and the normalisers'
statistics); over GLOBAL every rank learns every finished episode, so all stop at the same
update. With a colocated layout (no rollout ranks) only the episodes move.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from app.runtime.algorithm import Segment
from app.runtime.handoff.base import HandOffSettings, Round
from app.runtime.segments import SegmentFormat
from app.runtime.worker import Episode, as_segment
from rlcomm import CommContext, LayoutPlan, ParallelMode, collectives
from rlcomm.weights import WeightReceiver, WeightSender, WeightTransferError

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


class FlatHandOff:
    """A static layout's hand-off (see the module's doc): segments gathered and whole weights
    broadcast over WEIGHT_TRANSFER, episodes shared over GLOBAL, with the time each rank spent
    blocked and the bytes it sent.

    Built before DDP wraps ``agent``: a trainer binds it to its send buffer (the parameters then
    live there, and DDP and the optimizer hold the same Parameter objects as ever), a rollout
    rank to its receiver (loads point the policy at the received bytes).
    """

    kind = "flat"

    def __init__(self, ctx: CommContext, plan: LayoutPlan, agent: torch.nn.Module,
                 segment_format: SegmentFormat, settings: HandOffSettings, weights: bool = True) -> None:
        """``weights=False``: a subclass sends the weights its own way."""
        self.ctx, self.agent = ctx, agent
        self.rank = ctx.get_global_rank()
        self.is_trainer = self.rank in plan.trainers
        self.has_rollout_ranks = not plan.colocated
        self.collectors = len(plan.trainers) if plan.colocated else len(plan.rollouts)
        self.segment_format, self.max_staleness = segment_format, settings.max_staleness
        self.episode_cap = settings.episode_cap
        self.on_wait: Callable[[str], None] | None = None  # a static run never waits for joiners
        self.transfer_s = 0.0  # trainers: sending weights
        self.wait_s = 0.0  # this update's time blocked in the trainer <-> rollout hand-off
        self.wait_total_s = 0.0
        # Payload this rank sent to other ranks (weights by a trainer, trajectories by a rollout
        # rank), so a run can be checked against what the network carried.
        self.weight_bytes = sum(t.nbytes for t in agent.state_dict().values())
        self.weight_bytes_sent = 0
        self.trajectory_bytes_sent = 0
        self.staleness: dict[int, int] = {}  # version lag -> segments trained on (trainers)
        self.acting_version = 0  # the weights version the policy holds (rollouts)
        self.sender: WeightSender | None = None
        self.receiver: WeightReceiver | None = None
        if not weights:
            return
        if self.has_rollout_ranks and self.is_trainer:
            self.sender = WeightSender(ctx, WT, verify_every=settings.verify_every)
            self.sender.bind(agent)
        elif self.has_rollout_ranks:
            self.receiver = policy_receiver(ctx, agent)
            self.receiver.bind(agent)

    def version(self, updates: int) -> int:
        """The weights version this rank acts (rollouts) or trains (trainers) with; colocated,
        where nothing is sent, the number of updates done."""
        if self.sender is not None:
            return self.sender.version
        if self.receiver is not None:
            return self.acting_version
        return updates

    def sync_weights(self, first: bool) -> bool:
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
            self.sender.send(self.agent, wait=first)  # bound: no state dict, no copy
            self.transfer_s += time.perf_counter() - tick
            receivers = len(self.ctx.get_ranks_in_group(WT)) - 1
            self.weight_bytes_sent += receivers * self.weight_bytes
        elif self.receiver is not None:
            self.acting_version = receive_weights(
                [(self.receiver, self.agent)], first, self.max_staleness)
            self.wait_s += time.perf_counter() - tick
        return True

    def before_optimizer_step(self) -> None:
        """A trainer's last send must be complete: the optimizer rewrites the bytes being sent."""
        if self.sender is not None:
            tick = time.perf_counter()
            self.sender.wait()
            self.transfer_s += time.perf_counter() - tick

    def exchange(self, own: torch.Tensor | None, mine: list[Episode], updates: int) -> Round:
        """This update's segments (a trainer with rollout ranks: theirs; colocated: its own)
        and every rank's finished episodes."""
        if self.has_rollout_ranks:
            segments = self._gather_segments(own, updates)
        else:
            segments = [as_segment(self.segment_format, own)] if own is not None else []
        lag = max((s.lag for s in segments), default=0)
        episodes, shared = self._share_episodes(mine, lag)
        return Round(segments, episodes, {"segments": float(self.collectors), **shared})

    def update_done(self) -> None:
        """Nothing to time: a static run's membership does not change."""

    def stop(self, updates: int, env_steps: int) -> None:
        """Every rank stopped at the same update: nobody waits for a last message."""

    def result(self) -> dict[str, Any]:
        return {}

    def _gather_segments(self, own: torch.Tensor | None, updates: int) -> list[Segment]:
        """The segments the trainer trains on next, each with its version lag (a rollout rank
        gets none). ``own``: this rollout rank's packed segment; ``updates``: the number done."""
        packed = own if own is not None else self.segment_format.empty()
        trainer = self.ctx.get_declared_ranks(WT)[0]
        tick = time.perf_counter()
        gathered = collectives.gather(self.ctx, WT, packed, dst=trainer)
        if self.rank != trainer:
            self.trajectory_bytes_sent += packed.nbytes
        self.wait_s += time.perf_counter() - tick
        if gathered is None:
            return []
        members = self.ctx.get_ranks_in_group(WT)
        segments = [(r, as_segment(self.segment_format, t)) for r, t in zip(members, gathered)
                    if r != trainer]
        versions = [(r, s.version) for r, s in segments]
        lags = check_staleness(versions, self.version(updates), self.max_staleness, updates + 1)
        for (_, segment), lag in zip(segments, lags):
            segment.lag = lag
            self.staleness[lag] = self.staleness.get(lag, 0) + 1
        return [segment for _, segment in segments]

    def _share_episodes(
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


def receive_weights(receivers: list[tuple[WeightReceiver, torch.nn.Module]], first: bool,
                    max_staleness: int) -> int:
    """A rollout rank takes its next weights from one receiver or several (a sharded hand-off's,
    one per shard owner, each into its own module), all of one version; returns it.

    The first transfer and every one in lockstep (``max_staleness=0``) lands in the bytes the
    policy acts with: it is idle until they arrive (no second buffer, nothing to swap); from
    several senders, their transfers run side by side. Else the next version is posted (from
    several senders at once) and the newest arrived version swapped in, waiting only for what
    ``max_staleness`` requires.
    """
    if first or (max_staleness == 0 and len(receivers) == 1):
        versions = [receiver.receive_into(module) for receiver, module in receivers]
    elif max_staleness == 0:  # several senders in lockstep: in place, side by side
        for receiver, _ in receivers:
            receiver.post(in_place=True)
        for receiver, _ in receivers:
            receiver.receive()  # completes the posted receive
        versions = [receiver.load(module) for receiver, module in receivers]
    else:  # several senders: their transfers run side by side
        for receiver, _ in receivers:
            receiver.post()
        for receiver, _ in receivers:
            # The trainer will train the next segment with the version just posted.
            newest = receiver.version + receiver.posted
            while receiver.version < newest - max_staleness:
                receiver.receive()  # completes the oldest posted receive
        # A segment boundary: swap in the newest version that has arrived, the same from
        # every sender (one may have delivered more than another: the others catch up).
        versions = [receiver.load(module) for receiver, module in receivers]
        while len(set(versions)) > 1:
            top = max(versions)
            for receiver, _ in receivers:
                while receiver.version < top:
                    receiver.receive()
            versions = [receiver.load(module) for receiver, module in receivers]
    if len(set(versions)) > 1:
        raise WeightTransferError(f"the shard owners sent different weights versions {versions}")
    return versions[0]
