"""Membership epochs (rlcomm.elastic) on real gloo processes over 127.0.0.1: epoch groups and
their validation, join requests and admission, a lost member failing only its own transfers,
weights on an elastic group through CommContext, and a survivor following its leader to the
next epoch (app/runtime/membership.py's flow).

Every process of a test is forked from here and joins a TCPStore that this process hosts
(tests/helpers/store_processes.py).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

import pytest
import torch
from torch import distributed as dist
from torch import nn

from rlcomm import CommContext, ParallelMode
from rlcomm.elastic import (
    EpochRecords,
    Join,
    MembershipError,
    await_admission,
    build_epoch_group,
    epoch_members,
    graveyard,
    latest_epoch,
    receive_from_members,
    request_join,
    send_to_leader,
)
from rlcomm.weights import TransfersEnded, WeightReceiver, WeightSender
from tests.helpers.store_processes import STORE_TIMEOUT, meet, run_processes
from tests.helpers.weights import mismatches, restore, snapshot

pytestmark = pytest.mark.integration

WT = ParallelMode.WEIGHT_TRANSFER
GROUP_TIMEOUT = datetime.timedelta(seconds=30)  # gloo groups: a hang fails, a loaded CPU does not
LEADER = 0


def _die(code: int) -> None:
    """End at once, as a killed process would: no cleanup, its connections closed by the OS."""
    os._exit(code)


class CountingReceiver(WeightReceiver):
    """A WeightReceiver that counts the versions it verified (checksummed ones only)."""

    verified = 0

    def load(self, module: nn.Module, strict: bool = True) -> int:
        newest = self._buffers.newest
        checksummed = newest is not None and newest.checksummed
        version = super().load(module, strict)
        self.verified += int(checksummed and self._buffers.newest is newest)
        return version


def linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def segment_of(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float64) + 100.0 * rank


# ---- 1. build_epoch_group -----------------------------------------------------------------

def _epoch_group(rank: int, store: dist.Store, epochs: dict[int, int],
                 lists: dict[int, list[int]]) -> str:
    """Every rank builds its epoch group (its epoch and member list from the maps, default
    epoch 1 of [0, 1, 2]); with all defaults, allreduces its rank + 1 on it. Returns the sum,
    "formed" or its MembershipError."""
    members = lists.get(rank, [0, 1, 2])
    try:
        group = build_epoch_group(store, LEADER, epochs.get(rank, 1), members, rank,
                                  datetime.timedelta(seconds=5) if epochs else GROUP_TIMEOUT)
    except MembershipError as err:
        return f"MembershipError: {err}"
    graveyard.append(group)
    if epochs or lists:  # a member refused it: nothing more on it
        return "formed"
    total = torch.tensor([float(rank + 1)])
    group.allreduce([total]).wait()
    return f"sum {total.item():g}"


def test_three_processes_form_an_epoch_group_and_allreduce_on_it() -> None:
    results = run_processes(_epoch_group, 3, {}, {})
    assert results == {0: "sum 6", 1: "sum 6", 2: "sum 6"}


def _list_mismatch() -> dict[int, str]:
    # Rank 2 takes rank 1's place for rank 5: same size, same position, another list.
    return run_processes(_epoch_group, 3, {}, {2: [0, 5, 2]})


def test_a_member_with_another_member_list_is_refused_naming_the_ranks() -> None:
    refused = _list_mismatch()[2]
    assert refused.startswith(
        "MembershipError: rank 2: epoch 1 of rank 0's group should be ranks [0, 5, 2]; "
        "its members report (epoch, rank) [(1, 0), (1, 1), (1, 2)]"
    ), refused


@pytest.mark.parametrize("disagreement", ["member list", "epoch"])
def test_every_member_refuses_an_epoch_group_one_member_disagrees_on(disagreement: str) -> None:
    if disagreement == "member list":
        results, epoch = _list_mismatch(), {0: 1, 1: 1, 2: 1}
    else:
        results, epoch = run_processes(_epoch_group, 3, {0: 1, 1: 1, 2: 2}, {}), {0: 1, 1: 1, 2: 2}
    for rank, outcome in results.items():
        members = "[0, 5, 2]" if disagreement == "member list" and rank == 2 else "[0, 1, 2]"
        assert outcome.startswith(
            f"MembershipError: rank {rank}: epoch {epoch[rank]} of rank 0's group"), outcome
        assert members in outcome, outcome


# ---- 2. Membership, request_join, await_admission -----------------------------------------

def _admission(rank: int, store: dist.Store) -> dict[str, Any]:
    if rank == 0:  # the leader
        membership = EpochRecords(store, LEADER, planned=[0, 1, 2])
        records = {"epoch 0": epoch_members(store, LEADER, 0), "latest 0": latest_epoch(store, LEADER)}
        before = membership.pending_joins()
        store.set("test/membership", "1")
        joins: list[Join] = []
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while not any(j.rank == 2 for j in joins) and time.monotonic() < deadline:
            joins += membership.pending_joins()  # the stray joins come first, if at all
            time.sleep(0.02)
        epoch = membership.announce([1, 2], joins)
        return {
            **records, "before": before, "joins": [(j.rank, j.host, j.pid) for j in joins],
            "epoch": epoch, "epoch 1": epoch_members(store, LEADER, 1),
            "latest 1": latest_epoch(store, LEADER), "after": membership.pending_joins(),
        }
    store.wait(["test/membership"])  # a join before the leader's Membership is not seen
    stray = request_join(store, LEADER, 5)  # not in the planned group
    own = request_join(store, LEADER, LEADER)  # the leader's own rank
    join = request_join(store, LEADER, 2)
    admitted = await_admission(store, LEADER, join, timeout_s=STORE_TIMEOUT.total_seconds())
    tick = time.monotonic()
    try:
        await_admission(store, LEADER, stray, timeout_s=0.5)
        refused = "admitted"
    except MembershipError as err:
        refused = str(err)
    return {
        "join": (join.rank, join.host, join.pid), "own": (own.rank, own.pid),
        "pid": os.getpid(), "host": socket.gethostname(), "admitted": admitted,
        "refused": refused, "waited_s": time.monotonic() - tick,
    }


def test_a_leader_admits_a_planned_joiner_into_the_next_epoch() -> None:
    results = run_processes(_admission, 2)
    leader, joiner = results[0], results[1]
    assert joiner["join"] == (2, joiner["host"], joiner["pid"])
    assert leader["epoch 0"] == [0, 1, 2] and leader["latest 0"] == 0
    assert leader["before"] == []
    # rank 5 (not planned) and rank 0 (the leader's) were asked for first: ignored
    assert leader["joins"] == [(2, joiner["host"], joiner["pid"])]
    assert leader["epoch"] == 1
    assert leader["epoch 1"] == [0, 1, 2] and leader["latest 1"] == 1
    assert leader["after"] == []  # a join is seen once
    assert joiner["admitted"] == (1, [0, 1, 2])
    assert joiner["refused"] == "rank 5: rank 0 did not admit it within 0.5 s", joiner["refused"]
    assert joiner["waited_s"] >= 0.5


# ---- 3. a lost member fails only its own transfers ----------------------------------------

REPLY_TAG = 7


def _lost_member(rank: int, store: dist.Store, when: str) -> dict[str, Any]:
    group = build_epoch_group(store, LEADER, 1, [0, 1, 2], rank, GROUP_TIMEOUT)
    graveyard.append(group)
    meet(store, "test/built", 3)
    if rank == 2:
        if when == "in flight":  # the leader's receives are posted when it goes
            store.wait(["test/receiving"])
            time.sleep(0.5)
        _die(3)
    if rank == 1:
        send_to_leader(group, segment_of(1))
        reply = torch.zeros(3)
        group.recv([reply], 0, REPLY_TAG).wait()
        return {"reply": reply.tolist()}
    failed_send = ""
    if when == "noticed":  # as a weights send to it failing first: the loss is known
        deadline = time.monotonic() + GROUP_TIMEOUT.total_seconds()
        while not failed_send and time.monotonic() < deadline:
            try:
                group.send([torch.zeros(1)], 2, REPLY_TAG).wait()
            except RuntimeError as err:
                failed_send = str(err)
            time.sleep(0.02)
    buffers = {1: torch.zeros(6, dtype=torch.float64), 2: torch.zeros(6, dtype=torch.float64)}
    store.set("test/receiving", "1")
    lost = receive_from_members(group, buffers, {1: 1, 2: 2})
    group.send([torch.tensor([1.0, 2.0, 3.0])], 1, REPLY_TAG).wait()  # the same group goes on
    return {"lost": lost, "segment": buffers[1].tolist(), "failed_send": bool(failed_send)}


@pytest.mark.parametrize("when", [
    "in flight",
    "noticed",
])
def test_a_lost_member_fails_only_its_own_transfers(when: str) -> None:
    results = run_processes(_lost_member, 3, when, exits={2: 3})
    leader, survivor = results[0], results[1]
    assert leader["lost"] == {2: "connection closed"}
    assert leader["segment"] == segment_of(1).tolist()
    assert survivor["reply"] == [1.0, 2.0, 3.0]
    assert leader["failed_send"] == (when == "noticed")


# ---- 4. weights on an elastic group through CommContext -----------------------------------

def _elastic_weights(rank: int, store: dist.Store, moved: bool) -> dict[str, Any]:
    ctx = CommContext()
    ctx.join_running_job(store, rank, 3, timeout=int(GROUP_TIMEOUT.total_seconds()))
    try:
        joined = ctx.joined_running_job and not ctx.is_initialized()
        group = build_epoch_group(store, LEADER, 1, [0, 1, 2], rank, ctx.timeout)
        ctx.epochs.register(ctx, WT, group, [0, 1, 2])
        graveyard.append(group)
        seen = {"joined": joined, "elastic": ctx.epochs.holds(WT),
                "local": ctx.get_local_rank(WT), "ranks": ctx.get_ranks_in_group(WT)}
        if rank == LEADER:
            module = linear(seed=0)
            sender = WeightSender(ctx, WT, verify_every=0, first_version=5)
            version = sender.send(module.state_dict(), verify=True)
            for work in sender.end(moved=moved):  # every member is alive: all complete
                work.wait()
            return {**seen, "version": version, "after": sender.version,
                    "state": snapshot(module.state_dict())}
        module = linear(seed=rank)  # other values: only a transfer makes them equal
        receiver = CountingReceiver(ctx, WT)
        version = receiver.receive_into(module)
        try:
            receiver.receive_into(module)
            ended: tuple[bool, str] | str = "another version"
        except TransfersEnded as err:
            ended = (err.moved, str(err))
        return {**seen, "version": version, "verified": receiver.verified, "ended": ended,
                "state": snapshot(module.state_dict())}
    finally:
        ctx.destroy(barrier=False)


@pytest.mark.parametrize("moved", [True, False])
def test_weights_on_an_elastic_group_then_the_sender_ends(moved: bool) -> None:
    results = run_processes(_elastic_weights, 3, moved)
    sent = restore(results[0].pop("state"))
    assert mismatches(sent, linear(seed=0).state_dict()) == []
    assert results[0]["version"] == 6 and results[0]["after"] == 6
    how = "moved to a new membership epoch" if moved else "stopped"
    for rank in (0, 1, 2):
        result = results[rank]
        assert result["joined"] and result["elastic"], (rank, result)
        assert result["local"] == rank and result["ranks"] == [0, 1, 2]
        if rank == 0:
            continue
        assert result["version"] == 6
        assert result["verified"] == 1  # verify=True checksummed it despite verify_every=0
        assert mismatches(restore(result["state"]), sent) == []
        assert result["ended"] == (
            moved, f"WEIGHT_TRANSFER[0,1,2]: sender rank 0 {how} after version 6"
        ), result["ended"]


# ---- 5. an epoch change with a survivor ---------------------------------------------------

def _epoch_change(rank: int, store: dist.Store) -> dict[str, Any]:
    ctx = CommContext()
    ctx.join_running_job(store, rank, 3, timeout=int(GROUP_TIMEOUT.total_seconds()))
    try:
        if rank == LEADER:
            return _leader_changes_epoch(ctx, store)
        members = epoch_members(store, LEADER, 0)  # waits for the leader's record
        group = build_epoch_group(store, LEADER, 0, members, rank, ctx.timeout)
        ctx.epochs.register(ctx, WT, group, members)
        module = linear(seed=rank)
        receiver = CountingReceiver(ctx, WT)
        first = receiver.receive_into(module)
        if rank == 2:  # lost while the leader waits for its segment
            store.wait(["test/receiving"])
            time.sleep(0.5)
            _die(3)
        send_to_leader(ctx.get_group(WT), segment_of(rank))
        try:
            receiver.receive_into(module)
            return {"ended": "another version"}
        except TransfersEnded as err:
            moved = err.moved
        # app/runtime/membership/rollouts.py's EpochMember._follow, then _enter
        graveyard.append((receiver, ctx.get_group(WT), receiver.abandon()))
        epoch = latest_epoch(store, LEADER)
        members = epoch_members(store, LEADER, epoch)
        group = build_epoch_group(store, LEADER, epoch, members, rank, ctx.timeout)
        ctx.epochs.register(ctx, WT, group, members)
        graveyard.append(group)
        receiver = CountingReceiver(ctx, WT)
        version = receiver.receive_into(module)
        return {"first": first, "moved": moved, "epoch": epoch, "members": members,
                "ranks": ctx.get_ranks_in_group(WT), "version": version,
                "verified": receiver.verified, "state": snapshot(module.state_dict())}
    finally:
        ctx.destroy(barrier=False)


def _leader_changes_epoch(ctx: CommContext, store: dist.Store) -> dict[str, Any]:
    membership = EpochRecords(store, LEADER, planned=[0, 1, 2])
    old = membership.group(LEADER, ctx.timeout)
    ctx.epochs.register(ctx, WT, old, [LEADER, *membership.members])
    module = linear(seed=0)
    sender = WeightSender(ctx, WT, verify_every=0)
    first = sender.send(module, wait=True)
    buffers = {m: torch.zeros(6, dtype=torch.float64) for m in membership.members}
    store.set("test/receiving", "1")
    lost = receive_from_members(old, buffers, {1: 1, 2: 2})
    # app/runtime/membership/rollouts.py's EpochLeader.change: the record, then "moved"
    epoch = membership.announce([m for m in membership.members if m not in lost], [])
    graveyard.append((sender, old, sender.end(moved=True)))
    new = membership.group(LEADER, ctx.timeout)
    ctx.epochs.register(ctx, WT, new, [LEADER, *membership.members])
    graveyard.append(new)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(1.0)
    sender = WeightSender(ctx, WT, verify_every=0, first_version=sender.version)
    version = sender.send(module, wait=True, verify=True)
    return {"first": first, "lost": lost, "segment": buffers[1].tolist(), "epoch": epoch,
            "members": membership.members, "version": version,
            "state": snapshot(module.state_dict())}


def test_a_survivor_follows_its_leader_to_the_next_epoch() -> None:
    results = run_processes(_epoch_change, 3, exits={2: 3})
    leader, survivor = results[0], results[1]
    assert leader["first"] == 1
    assert leader["lost"] == {2: "connection closed"}
    assert leader["segment"] == segment_of(1).tolist()
    assert leader["epoch"] == 1 and leader["members"] == [1]
    assert leader["version"] == 2
    assert survivor["first"] == 1
    assert survivor["moved"] is True
    assert survivor["epoch"] == 1 and survivor["members"] == [0, 1]
    assert survivor["ranks"] == [0, 1]
    assert survivor["version"] == 2 and survivor["verified"] == 1
    sent = restore(leader["state"])
    assert mismatches(restore(survivor["state"]), sent) == []
    assert mismatches(sent, linear(seed=0).state_dict()) != []  # version 2 is not version 1


# ---- 6. a replaced epoch group outlives its replacement ---------------------------------------

def _replaced_group(rank: int, store: dist.Store) -> dict[str, Any]:
    import gc
    import weakref

    ctx = CommContext()
    ctx.join_running_job(store, rank, 2, timeout=int(GROUP_TIMEOUT.total_seconds()))
    try:
        old = build_epoch_group(store, LEADER, 1, [0, 1], rank, ctx.timeout)
        ctx.epochs.register(ctx, WT, old, [0, 1])
        kept = weakref.ref(old)
        del old
        new = build_epoch_group(store, LEADER, 2, [0, 1], rank, ctx.timeout)
        ctx.epochs.register(ctx, WT, new, [0, 1])
        del new
        gc.collect()
        # Nobody put the old group in the graveyard: the context keeps it (a lost member's
        # transfer may still be posted on it), and the new one is the mode's group.
        return {"old_alive": kept() is not None, "current": ctx.get_group(WT) is not kept()}
    finally:
        ctx.destroy(barrier=False)


def test_a_replaced_epoch_group_is_kept_alive() -> None:
    results = run_processes(_replaced_group, 2)
    assert results == {0: {"old_alive": True, "current": True},
                       1: {"old_alive": True, "current": True}}
