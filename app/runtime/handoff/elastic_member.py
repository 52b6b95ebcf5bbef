"""An elastic rollout rank's side of the hand-off (app/runtime/handoff/elastic.py has the
trainer's and the protocol): it sends its segments to its trainer, takes the weights it sends,
and follows it to each new membership epoch, or asks to be admitted when it replaces a lost
process."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from app.runtime.handoff.base import HandOffSettings, Round
from app.runtime.handoff.elastic import WT, epoch_timeout
from app.runtime.handoff.flat import policy_receiver
from app.runtime.segments import SegmentFormat, pack_episodes
from app.runtime.worker import Episode
from rlcomm import CommContext
from rlcomm.elastic import (
    acknowledge,
    await_admission,
    build_epoch_group,
    describe_loss,
    graveyard,
    latest_epoch,
    request_join,
    send_to_leader,
)
from rlcomm.weights import TransfersEnded, WeightReceiver

log = logging.getLogger(__name__)


class ElasticMember:
    """A rollout rank's side: send segments to its trainer, take the weights it sends, follow it
    to each new epoch; ``joining``: this process replaces a lost one and asks to be admitted."""

    kind = "elastic"

    def __init__(self, ctx: CommContext, agent: torch.nn.Module, segment_format: SegmentFormat,
                 leader: int, settings: HandOffSettings, joining: bool) -> None:
        self.ctx, self.agent, self.segment_format = ctx, agent, segment_format
        self.rank = ctx.get_global_rank()
        self.leader, self.max_staleness = leader, settings.max_staleness
        self.timeout_s = settings.timeout_s
        self.joining = joining
        self.wait_s = self.wait_total_s = self.transfer_s = 0.0
        self.trajectory_bytes_sent = self.weight_bytes_sent = 0
        self.staleness: dict[int, int] = {}  # a member trains nothing
        self.on_wait: Callable[[str], None] | None = None
        self.acting_version = 0
        self.segments_sent = 0
        # Lost with its group while sending, this rank followed its trainer to a new epoch and
        # holds that epoch's first weights: the next sync has nothing to take.
        self.followed = False
        self.epochs_followed = 0
        self.final: dict[str, Any] = {}  # the job's counts at the stop (ElasticLeader.stop)
        self.receiver: WeightReceiver
        self.patience = epoch_timeout(ctx, self.timeout_s)
        if joining:
            self._join()
        else:  # epoch 0: the planned group's members
            planned = [leader, *[r for r in ctx.get_declared_ranks(WT) if r != leader]]
            group = build_epoch_group(ctx.store, leader, 0, planned, self.rank, self.patience)
            ctx.register_epoch_group(WT, group, planned)
            self.epoch = 0
            self._start_weights()

    # ---- the weights: whole, from the trainer (elastic_sharded.py overrides these) ----------

    def _start_weights(self) -> None:
        """Epoch 0's receiver, bound to the agent (zero-copy loads)."""
        self.receiver = policy_receiver(self.ctx, self.agent)
        self.receiver.bind(self.agent)

    def _first_weights(self) -> None:
        """A new epoch's first weights: complete before acting, verified by their checksums."""
        self._start_weights()
        self.acting_version = self.receiver.receive_into(self.agent)

    def _abandon_weights(self) -> None:
        """No more versions come on this epoch's group(s): keep what was posted alive."""
        graveyard.append((self.receiver, self.ctx.get_group(WT), self.receiver.abandon()))

    def version(self, updates: int) -> int:
        return self.acting_version

    def exchange(self, own: torch.Tensor | None, mine: list[Episode], updates: int) -> Round | None:
        """Sends this rank's segment to its trainer; None once the run stopped."""
        assert own is not None
        lost = self.send_segment(own, mine)
        if lost is None:
            self.segments_sent += 1
            return Round(shared={"segments": 1.0})
        self.followed = lost
        return Round(shared={"segments": 0.0}) if lost else None

    def before_optimizer_step(self) -> None:
        """A member trains nothing."""

    def update_done(self) -> None:
        """A member times nothing: its trainer records the joins and leaves."""

    def stop(self, updates: int, env_steps: int) -> None:
        """The trainer stops the members, not the reverse."""

    def result(self) -> dict[str, Any]:
        """The job's counts, as its trainer stopped at, like every rank reports them; then this
        rank's own: the segments it sent, its epoch, whether it joined a running job."""
        return {"updates": self.final.get("updates"), "env_steps": self.final.get("env_steps"),
                "segments_sent": self.segments_sent, "epoch": self.epoch,
                "joined": self.joining}

    def _join(self) -> None:
        while True:
            join = request_join(self.ctx.store, self.leader, self.rank)
            log.info("rank %d (%s) asks rank %d to admit it", self.rank, socket.gethostname(),
                     self.leader)
            epoch, _ = await_admission(self.ctx.store, self.leader, join, self.timeout_s)
            members = acknowledge(self.ctx.store, self.leader, epoch, self.rank,
                                  self.ctx.timeout)
            if members is not None:
                self._enter(epoch, members)
                return
            log.warning("rank %d: answered epoch %d too late; asking again", self.rank, epoch)

    def _enter(self, epoch: int, members: list[int]) -> None:
        group = build_epoch_group(self.ctx.store, self.leader, epoch, members, self.rank,
                                  self.patience)
        self.ctx.register_epoch_group(WT, group, members)
        self.epoch = epoch
        self._first_weights()
        log.info("rank %d: in epoch %d of rank %d's group (members %s), weights version %d",
                 self.rank, epoch, self.leader, members[1:], self.acting_version)

    def _follow(self) -> bool:
        """The trainer moved to a new epoch: go with it, or ask to join again if it has
        dropped this rank (it took it for lost); False if a newer process replaced this one."""
        self._abandon_weights()
        epoch = latest_epoch(self.ctx.store, self.leader)
        deadline = time.monotonic() + self.timeout_s
        while epoch <= self.epoch and time.monotonic() < deadline:  # not written yet
            time.sleep(0.01)
            epoch = latest_epoch(self.ctx.store, self.leader)
        self.epochs_followed += 1
        replaced = f"elastic/{self.leader}/replaced/{self.rank}"
        if self.ctx.store.check([replaced]):
            newer = int(self.ctx.store.get(replaced))
            if newer != os.getpid():  # the member of this rank is that process now
                log.warning("rank %d (pid %d): replaced by a newer process (pid %d); stopping",
                            self.rank, os.getpid(), newer)
                return False
        members = acknowledge(self.ctx.store, self.leader, epoch, self.rank, self.ctx.timeout)
        if members is not None:
            self._enter(epoch, members)
            return True
        self._join()
        return True

    def _after_failure(self, err: BaseException) -> bool:
        """A transfer on this rank's group failed. gloo closes every connection of a group when
        one transfer on it times out, so a trainer's wait for a member whose link went down ends
        its group with the survivors too, before it can tell them "moved" (and a survivor's own
        wait times out as the trainer's does). Waits (up to ``comm.timeout``) for the trainer to
        form a newer epoch (True: follow it) or to stop (False); re-raises if it does neither
        (the trainer is lost)."""
        deadline = time.monotonic() + self.timeout_s
        store, prefix = self.ctx.store, f"elastic/{self.leader}/"
        try:
            while latest_epoch(store, self.leader) <= self.epoch:
                if store.check([prefix + "final"]):  # the run stopped meanwhile
                    return self._stopped()
                if time.monotonic() > deadline:
                    raise err
                time.sleep(0.05)
        except RuntimeError:  # the store is gone with the trainer's host
            raise err from None
        log.warning("rank %d: its group with rank %d failed (%s); rank %d formed a new epoch: "
                    "following it", self.rank, self.leader, describe_loss(err), self.leader)
        return True

    def _stopped(self) -> bool:
        """The run stopped: the job's counts, as the trainer left them in the store."""
        self.final = json.loads(self.ctx.store.get(f"elastic/{self.leader}/final"))
        return False

    def send_segment(self, packed: torch.Tensor, episodes: list[Episode]) -> bool | None:
        """Sends this segment; None if it was sent, else whether to go on (it was lost with the
        group: True when this rank followed its trainer to a new epoch and holds its weights,
        False when the run stopped)."""
        pack_episodes(self.segment_format, packed, episodes, self.wait_s)
        self.wait_total_s += self.wait_s
        self.wait_s = 0.0
        tick = time.perf_counter()
        try:
            send_to_leader(self.ctx.get_group(WT), packed)
        except RuntimeError as err:
            going = self._after_failure(err) and self._follow()
            self.wait_s += time.perf_counter() - tick
            return going
        self.trajectory_bytes_sent += packed.nbytes
        self.wait_s += time.perf_counter() - tick
        return None

    def sync_weights(self, first: bool) -> bool:
        """Takes the next weights (as the static hand-off does); False once the run stopped."""
        if self.followed:  # a new epoch's first weights came with following it
            self.followed = False
            return True
        tick = time.perf_counter()
        try:
            self._take_weights(first)
        except TransfersEnded as ended:
            if not ended.moved:
                self._abandon_weights()
                return self._stopped()
            return self._follow()
        except RuntimeError as err:  # gloo's error, or rlcomm's HangError around it
            return self._after_failure(err) and self._follow()
        finally:
            self.wait_s += time.perf_counter() - tick
        return True

    def _take_weights(self, first: bool) -> None:
        """The next weights, as the static hand-off takes them."""
        if first:
            if self.acting_version == 0:
                self.acting_version = self.receiver.receive_into(self.agent)
        elif self.max_staleness == 0:
            # Beside the weights acted with, not in place: the trainer's last message (stop,
            # or moved to a new epoch) carries no version and must not overwrite them.
            self.receiver.receive()
            self.acting_version = self.receiver.load(self.agent)
        else:
            self.receiver.post()
            newest = self.receiver.version + self.receiver.posted
            while self.receiver.version < newest - self.max_staleness:
                self.receiver.receive()
            self.acting_version = self.receiver.load(self.agent)
