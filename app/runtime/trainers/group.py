"""The trainers' membership: TRAIN_DATA_PARALLEL as epochs of the trainers
(``layout.elastic_trainers``, docs/failures.md).

The lead trainer (the plan's first: it holds the run's records and decisions) leads; the other
trainers are members. Epoch 0 is the planned trainers, built as an epoch group (rlcomm.elastic)
whose timeout is half the patience. Every collective over TRAIN_DATA_PARALLEL goes through
rlcomm.collectives, which on a failure calls :meth:`TrainerGroup.recover` (the context's
recovery for the mode, ``ctx.recovery``) and runs the call again on the group it forms:

- the lead proposes the next epoch with every member; a live member, whose call on the old
  group failed too, acknowledges it; one whose process on the lead's host has ended, or that
  neither acknowledges nor beats its heartbeat for ``BEAT_LOST_S``, is lost ("killed" when its
  connection closed, else "timed out"), and the patience bounds the wait for any;
- the survivors build the epoch's group; the lost trainers' rollout ranks move to them (the
  ``adopt`` records that rlcomm's member side reads, app/runtime/handoff/membership_epochs.py);
- a member the lead took for lost learns it on its next call and leaves (PeerLostError: under
  the local launcher its slot starts it again while ``launcher.trainer_restarts`` allow).

A new process for a lost trainer asks to join; at an update boundary (:meth:`boundary`) the
trainers agree on admitting it, form the next epoch with it, and it heals from the lead
(app/runtime/trainers/healing.py). The update that a loss broke is the trainer role's to redo
(app/runtime/roles/trainer.py): no optimizer steps on a gradient of two groups.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from app.runtime.handoff.membership_epochs import ADOPT, Change
from rlcomm import CommContext, ParallelMode, collectives
from rlcomm.elastic import (
    TRAINER_SPACE,
    Join,
    acknowledge,
    await_admission,
    build_epoch_group,
    close_membership,
    closing_members,
    epoch_members,
    latest_epoch,
    request_join,
)
from rlcomm.elastic import Membership as EpochRecords
from rlcomm.errors import MembersLostError, PeerLostError
from rlcomm.net.gloo_words import describe_loss

log = logging.getLogger(__name__)

TDP = ParallelMode.TRAIN_DATA_PARALLEL
SPACE = TRAINER_SPACE  # the trainers' epochs: keys and groups under elastic/<lead>/trainers/
BEAT_S = 0.2  # how often each trainer beats its heartbeat
BEAT_LOST_S = 1.5  # a trainer that did not answer and whose heartbeat stood still this long is lost


Adopt = Callable[[list[int]], None]  # this trainer takes these rollout ranks


def process_ended(pid: int) -> bool:
    """Whether the process ``pid`` of this host has ended (gone, or a zombie its parent has not
    reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class Heartbeat:
    """A counter in the store that a thread of this trainer advances every ``BEAT_S``, over a
    connection of its own (the main thread's store calls may wait long). A stopped or killed
    process stops it."""

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store.clone(), key
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="rlcomm-trainer-heartbeat",
                                       daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopping.wait(BEAT_S):
            try:
                self.store.add(self.key, 1)
            except RuntimeError:  # the store is gone: the run ended
                return

    def stop(self) -> None:
        self.stopping.set()


class TrainerGroup:
    """This trainer's side of the trainers' membership (see the module's doc). ``trainers``:
    the planned ones, lead first; ``adopt``: told which lost trainers' rollout ranks this one
    takes; ``joining``: this process replaces a lost trainer; ``holds``: what this trainer alone
    holds (its own replay shard's transitions), lost with it and counted."""

    def __init__(self, ctx: CommContext, trainers: list[int], hosts: dict[int, str],
                 patience: datetime.timedelta, adopt: Adopt, joining: bool = False,
                 holds: Callable[[], int] | None = None) -> None:
        self.ctx, self.adopt, self.joining, self.holds = ctx, adopt, joining, holds
        self.lead, self.rank = trainers[0], ctx.get_global_rank()
        self.patience, self.patience_s = patience, patience.total_seconds()
        self.hosts = dict(hosts)
        self.planned = list(trainers)
        self.members = list(trainers)  # every live trainer, lead first
        self.epoch = 0
        self.update = 0  # the update being made, for the records
        self.epoch_at_start = 0  # the epoch that update started in
        self.changes: list[Change] = []
        self.records: EpochRecords | None = None
        self.heartbeat: Heartbeat | None = None
        self.processes: dict[int, int] = {}  # rank -> pid, of the current epoch
        self.stopped = False

    @property
    def leads(self) -> bool:
        return self.rank == self.lead

    def _key(self, name: str) -> str:
        return f"elastic/{self.lead}/{SPACE}{name}"

    # ---- forming -------------------------------------------------------------------------

    def begin(self) -> None:
        """Forms (or, joining, asks to be admitted to) the trainers' group; from here on a
        failed call over TRAIN_DATA_PARALLEL recovers through this group."""
        # Each process beats a key of its own: a replacement's beats are not its predecessor's.
        self.ctx.store.set(self._key(f"process/{self.rank}"), str(os.getpid()))
        self.heartbeat = Heartbeat(self.ctx.store, self._key(f"beat/{self.rank}/{os.getpid()}"))
        if self.leads:
            self.records = EpochRecords(self.ctx.store, self.lead, self.planned, space=SPACE)
        if self.joining:
            self._join()
        else:
            self._register(0, self.planned)
        self.ctx.recovery.set(TDP, self.recover)

    def _register(self, epoch: int, members: list[int]) -> None:
        # Half the patience: the trainers settle a loss among them before their rollout ranks'
        # groups, whose timeout is the whole patience, give up on a trainer that waited.
        group = build_epoch_group(self.ctx.store, self.lead, epoch, members, self.rank,
                                  self.patience / 2, SPACE)
        broken = self._key(f"broken/{epoch}")
        self.ctx.register_epoch_group(TDP, group, members,
                                      broken=lambda: bool(self.ctx.store.check([broken])))
        self.epoch, self.members = epoch, list(members)
        # The processes in it (each wrote its own before it built the group).
        self.processes = {r: int(self.ctx.store.get(self._key(f"process/{r}"))) for r in members}

    def _join(self) -> None:
        join = request_join(self.ctx.store, self.lead, self.rank, SPACE)
        log.info("rank %d (%s) asks the lead trainer, rank %d, to admit it", self.rank,
                 socket.gethostname(), self.lead)
        timeout_s = self.ctx.timeout.total_seconds()
        epoch, _ = await_admission(self.ctx.store, self.lead, join, timeout_s, space=SPACE)
        members = acknowledge(self.ctx.store, self.lead, epoch, self.rank, self.ctx.timeout,
                              SPACE)
        if members is None:
            raise PeerLostError(f"rank {self.rank} (trainer): admitted to epoch {epoch} of the "
                                "trainers but answered too late")
        self._register(epoch, members)
        log.info("rank %d: in epoch %d of the trainers %s", self.rank, epoch, members)

    # ---- losing --------------------------------------------------------------------------

    def recover(self, err: BaseException) -> bool:
        """A call over TRAIN_DATA_PARALLEL failed with ``err``: the next epoch of the trainers
        is registered (True), or the run stopped meanwhile (False). Raises when this trainer
        was taken for lost, or when every other trainer is."""
        if self.stopped:
            return False
        # Declared broken first: a trainer still waiting on the group gives up at once (gloo
        # tells only those connected to the lost one), and the lead learns what was seen.
        broken = self._key(f"broken/{self.epoch}")
        if not self.ctx.store.check([broken]):
            self.ctx.store.set(broken, describe_loss(err))
        if self.leads:
            self._drop_lost(self.ctx.store.get(broken).decode())
        else:
            self._follow_lead(err)
        return True

    def _drop_lost(self, why: str) -> None:
        """The lead: the next epoch with the trainers that answer; ``why``: what the first
        trainer to see the group fail saw ("connection closed": a process ended)."""
        assert self.records is not None
        store, others = self.ctx.store, self.members[1:]
        beats = {r: self._beat_of(r) for r in others}
        since = time.monotonic()

        def gone(waiting: list[int]) -> list[int]:
            still = time.monotonic() - since > BEAT_LOST_S
            return [r for r in waiting if self._ended_here(r)
                    or (still and self._beat_of(r) == beats[r])]

        epoch = self.records.announce(others, [])
        tick = time.perf_counter()
        lost = self.records.confirm(self.patience_s, gone=gone)
        survivors = [self.lead, *self.records.members]
        reason = "killed" if "closed" in why else "timed out"
        adopted = self._adoptions(lost, survivors)
        store.set(self._key(f"adopted/{epoch}"), json.dumps(adopted))
        for rank in lost:
            self._record("leave", rank, reason, epoch)
            held = self._key(f"held/{rank}")
            if self.ctx.store.check([held]):
                self.changes[-1].lost_transitions = int(self.ctx.store.get(held))
        self._register(epoch, survivors)
        for survivor, ranks in adopted.items():
            for orphan in ranks:  # after the epoch formed: a survivor that takes it knows
                store.set(ADOPT.format(rank=orphan), str(survivor))
        self.adopt(adopted.get(str(self.lead), []))
        serving = self._serving(survivors, adopted)
        for rank in lost:
            log.warning("rank %d (trainer) left: %s; %d trainer%s go%s on, serving rollout "
                        "ranks %s (epoch %d, formed in %.3f s)", rank, why, len(survivors),
                        "" if len(survivors) == 1 else "s", "es" if len(survivors) == 1 else "",
                        ", ".join(map(str, serving)) or "none", epoch,
                        time.perf_counter() - tick)
        if not lost:
            log.warning("rank %d: the trainers' group failed (%s) but every trainer answered; "
                        "epoch %d formed", self.rank, why, epoch)

    def _adoptions(self, lost: list[int], survivors: list[int]) -> dict[str, list[int]]:
        """The lost trainers' rollout ranks, dealt round robin over the survivors."""
        orphans = [m for rank in lost for m in self._rollout_ranks(rank)]
        adopted: dict[str, list[int]] = {str(s): [] for s in survivors}
        for i, orphan in enumerate(sorted(orphans)):
            adopted[str(survivors[i % len(survivors)])].append(orphan)
        return adopted

    def _serving(self, survivors: list[int], adopted: dict[str, list[int]]) -> list[int]:
        """The rollout ranks the survivors have now, and those they take over."""
        serving = {r for ranks in adopted.values() for r in ranks}
        for survivor in survivors:
            serving.update(self._rollout_ranks(survivor))
        return sorted(serving)

    def _rollout_ranks(self, trainer: int) -> list[int]:
        """The members of ``trainer``'s latest group of rollout ranks (none if it has none)."""
        if not self.ctx.store.check([f"elastic/{trainer}/latest"]):
            return []
        return epoch_members(self.ctx.store, trainer, latest_epoch(self.ctx.store, trainer))[1:]

    def _ended_here(self, rank: int) -> bool:
        """Whether ``rank``'s process of this epoch runs on this host and has ended (at once,
        where its heartbeat would take ``BEAT_LOST_S`` to tell)."""
        if self.hosts.get(rank) != socket.gethostname():
            return False
        return process_ended(self.processes[rank])

    def _beat_of(self, rank: int) -> int:
        """The heartbeat of ``rank``'s process in the current epoch."""
        return int(self.ctx.store.add(self._key(f"beat/{rank}/{self.processes[rank]}"), 0))

    def _follow_lead(self, err: BaseException) -> None:
        """A member: waits for the lead's next epoch and goes to it; raises if the lead left
        this trainer out (it took it for lost) or formed none within the patience."""
        store = self.ctx.store
        deadline = time.monotonic() + 2 * self.patience_s
        while latest_epoch(store, self.lead, SPACE) <= self.epoch:
            if closing_members(store, self.lead, SPACE) is not None:  # the run stopped meanwhile
                raise PeerLostError(f"rank {self.rank} (trainer): the run stopped while its "
                                    f"group failed ({describe_loss(err)})") from err
            if time.monotonic() > deadline:
                raise err
            time.sleep(0.01)
        epoch = latest_epoch(store, self.lead, SPACE)
        members = acknowledge(store, self.lead, epoch, self.rank, self.ctx.timeout, SPACE)
        if members is None:
            raise PeerLostError(
                f"rank {self.rank} (trainer): left the trainers: the lead, rank {self.lead}, "
                f"formed epoch {epoch} without it (it did not answer within the patience, "
                f"{self.patience_s:g} s; its group: {describe_loss(err)})") from err
        adopted = json.loads(store.get(self._key(f"adopted/{epoch}")))
        self._register(epoch, members)
        self.adopt(adopted.get(str(self.rank), []))
        log.warning("rank %d: the trainers' group failed (%s); in epoch %d with %s",
                    self.rank, describe_loss(err), epoch, members)

    # ---- joining -------------------------------------------------------------------------

    def boundary(self, heal: Callable[[list[int]], None]) -> None:
        """At an update boundary, on every trainer: admits the processes that asked to join
        (every trainer agrees first) and heals them (``heal(joined)``, over the new group)."""
        joins = self.records.pending_joins() if self.records is not None else []
        flag = collectives.all_reduce(self.ctx, TDP, torch.tensor([float(len(joins))]))
        if not flag.item():
            return
        joined = self._admit(joins) if self.leads else self._follow_admission()
        heal(joined)

    def _admit(self, joins: list[Join]) -> list[int]:
        assert self.records is not None
        joining = sorted({j.rank for j in joins if j.rank not in self.members})
        for join in joins:
            self.hosts[join.rank] = join.host
        epoch = self.records.announce([*self.members[1:], *joining], joins)
        missing = self.records.confirm(self.patience_s)
        self.ctx.store.set(self._key(f"adopted/{epoch}"), "{}")
        members = [self.lead, *self.records.members]
        self._register(epoch, members)
        joined = [r for r in joining if r not in missing]
        for rank in joined:
            self._record("join", rank, "joined", epoch)
        return joined

    def _follow_admission(self) -> list[int]:
        before = list(self.members)
        store, deadline = self.ctx.store, time.monotonic() + self.patience_s
        while latest_epoch(store, self.lead, SPACE) <= self.epoch:
            if time.monotonic() > deadline:
                raise MembersLostError(f"rank {self.rank} (trainer): the lead formed no epoch "
                                       f"within {self.patience_s:g} s to admit a trainer")
            time.sleep(0.01)
        epoch = latest_epoch(store, self.lead, SPACE)
        members = acknowledge(store, self.lead, epoch, self.rank, self.ctx.timeout, SPACE)
        if members is None:
            raise PeerLostError(f"rank {self.rank} (trainer): left out of epoch {epoch}")
        self._register(epoch, members)
        return [r for r in members if r not in before]

    # ---- records -------------------------------------------------------------------------

    def _record(self, event: str, rank: int, reason: str, epoch: int) -> None:
        self.changes.append(Change(event, rank, self.hosts.get(rank, "?"), reason, epoch,
                                   self.update))

    def start_update(self, update: int) -> None:
        self.update, self.epoch_at_start = update, self.epoch

    def update_done(self) -> bool:
        """After an update: how long the survivors took to their next one; what this trainer
        alone holds, where the lead reads it if this one is lost. True: the trainers changed
        during the update."""
        if self.holds is not None:
            self.ctx.store.set(self._key(f"held/{self.rank}"), str(self.holds()))
        now = time.time()
        for change in self.changes:
            if change.event == "leave" and change.next_update_s is None:
                change.next_update_s = now - change.time
        return self.epoch != self.epoch_at_start

    def stop(self) -> None:
        """The run stopped: the live trainers, for the reports and any member in recovery."""
        self.stopped = True
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.leads:
            close_membership(self.ctx.store, self.lead, self.members, SPACE)
        self.ctx.recovery.set(TDP, None)

    def result(self) -> dict[str, Any]:
        """The trainers' epoch and who left and joined them (the lead's record)."""
        return {"trainer_epoch": self.epoch, "trainers": list(self.members),
                "trainer_changes": [c.record() for c in self.changes]}

