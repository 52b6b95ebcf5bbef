"""Weights proven identical, double-buffered posted receives, and the bound sender under DDP,
between real gloo processes. The checksums themselves, in this process, are
tests/unit/test_weight_checksums.py."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rlcomm import ParallelMode
from rlcomm.testing import run_ranks
from rlcomm.weights import (
    WeightReceiver,
    WeightSender,
    WeightTransferError,
    describe_state_dict,
    tensor_checksum,
)
from rlcomm.weights.buffers import FlatBuffers as _FlatBuffers
from rlcomm.weights.checksums import THREAD_NAME, ChecksumHelper
from tests.helpers.checksum_threads import declared_threads, helper_threads
from tests.helpers.weights import (
    TIMEOUT_S,
    make_trainable,
    mismatches,
    restore,
    snapshot,
    weight_groups,
)

TDP = ParallelMode.TRAIN_DATA_PARALLEL
_INHERITED = ChecksumHelper()  # started in the parent, used in a forked child


def small_tensors() -> dict[str, torch.Tensor]:
    """Over 1 MiB in tensors of under 32768 words each, which torch sums without its OpenMP
    threads: a forked child must not run an OpenMP region with two threads once its parent did
    (libgomp's team is the parent's and hangs in the child), whatever rlcomm does."""
    return {f"t{i}": torch.randn(8_000 + 3 * i).to(torch.bfloat16 if i % 2 else torch.float32)
            for i in range(48)}


def _child_of_a_helper(rank: int, world_size: int) -> Any:
    state = small_tensors()
    buffers = _FlatBuffers(describe_state_dict(state), torch.device("cpu"))
    buffers.pack(state)
    torch.set_num_threads(2)  # run_ranks declared one
    inherited = helper_threads()  # the parent's thread is not in this process
    equal = buffers.view_checksums(_INHERITED).tolist() == [tensor_checksum(t) for t in state.values()]
    started = helper_threads()
    _INHERITED.close()
    return {"inherited": inherited, "equal": equal, "started": started, "closed": helper_threads()}


@pytest.mark.integration
def test_a_helper_inherited_through_fork_starts_a_thread_of_its_own() -> None:
    state = small_tensors()
    buffers = _FlatBuffers(describe_state_dict(state), torch.device("cpu"))
    assert buffers.wire.nbytes > 1 << 20
    buffers.pack(state)
    with declared_threads(2):
        try:
            assert buffers.view_checksums(_INHERITED).tolist() == [tensor_checksum(t) for t in state.values()]
            assert helper_threads() == [f"{THREAD_NAME}_0"]
            child = run_ranks(_child_of_a_helper, 1, timeout=TIMEOUT_S)[0]
        finally:
            _INHERITED.close()
    assert child == {"inherited": [], "equal": True, "started": [f"{THREAD_NAME}_0"], "closed": []}


def _verified_on(rank: int, world_size: int, threads: int) -> Any:
    """A verified transfer of a large bound module; the checksum helper threads seen on this
    rank after it and after close()."""
    torch.set_num_threads(threads)
    with weight_groups([[0, 1]]) as ctx:
        torch.manual_seed(rank)
        module = nn.Sequential(nn.Linear(600, 600), nn.Linear(600, 3))  # 1.4 MiB of float32
        end: WeightSender | WeightReceiver
        if rank == 0:
            end = WeightSender(ctx, verify_every=1)
            end.bind(module)
            end.send(module)
        else:
            end = WeightReceiver(ctx)
            end.bind(module)
            assert end.receive_into(module) == 1  # verified: raises on a difference
        during = helper_threads()
        end.close()
        return {"during": during, "after": helper_threads(), "state": snapshot(module.state_dict())}


@pytest.mark.integration
def test_ranks_verify_with_a_helper_thread_only_where_they_declared_two() -> None:
    # Two threads: spawned ranks (see small_tensors: forked ones must not sum 1.4 MiB with two).
    for threads, during, start in ((1, [], "fork"), (2, [f"{THREAD_NAME}_0"], "spawn")):
        results = run_ranks(_verified_on, 2, threads, timeout=TIMEOUT_S, start_method=start)
        for rank in (0, 1):
            assert results[rank]["during"] == during, (threads, rank)
            assert results[rank]["after"] == [], (threads, rank)
        assert mismatches(restore(results[1]["state"]), restore(results[0]["state"])) == []


class CorruptingReceiver(WeightReceiver):
    """A real receiver whose received bytes get one bit flipped before they are loaded: what
    a faulty link or a stray write would do."""

    def _receive(self, in_place: bool) -> tuple[int, dict[str, torch.Tensor]]:
        version, state = super()._receive(in_place)  # every receive's way in, in place or not
        if version == 2:
            state["2.weight"].reshape(-1).view(torch.uint8)[5] ^= 0x10
        return version, state


def _corrupted(rank: int, world_size: int, bound: bool) -> Any:
    with weight_groups([[0, 1]]) as ctx:
        module = make_trainable(seed=rank)
        if rank == 0:
            out = WeightSender(ctx, verify_every=1)
            out.bind(module)
            for _ in range(2):
                out.send(module.state_dict())
            return None
        inp = CorruptingReceiver(ctx)
        if bound:
            inp.bind(module)
        assert inp.receive_into(module) == 1  # verified and intact
        try:
            inp.receive_into(module)
        except WeightTransferError as err:
            return str(err)
        return "no error"


@pytest.mark.integration
def test_a_byte_corrupted_in_flight_is_caught_naming_tensor_and_version() -> None:
    for bound in (True, False):
        error = run_ranks(_corrupted, 2, bound, timeout=TIMEOUT_S)[1]
        assert "weights version 2" in error and "'2.weight'" in error, error
        assert "differ from the sender's" in error


def _unverified(rank: int, world_size: int) -> Any:
    with weight_groups([[0, 1]]) as ctx:
        module = make_trainable(seed=rank)
        if rank == 0:
            out = WeightSender(ctx, verify_every=3)
            for _ in range(4):
                out.send(module.state_dict())
            return None
        inp = CorruptingReceiver(ctx)
        outcomes = []
        for _ in range(4):
            try:
                outcomes.append(inp.receive_into(module))
            except WeightTransferError:
                outcomes.append("error")
        return outcomes


@pytest.mark.integration
def test_only_every_nth_version_is_verified() -> None:
    # Version 2 is corrupted but not checksummed (verify_every=3): it loads unchecked; 3 is
    # checksummed and intact.
    assert run_ranks(_unverified, 2, timeout=TIMEOUT_S)[1] == [1, 2, 3, 4]


def _send_stepped(ctx: Any, module: nn.Module, versions: int, whole_module: bool) -> list[Any]:
    """The sender's side: ``versions`` verified sends of the bound ``module`` (itself, or its
    state dict), each after adding the step's number to every parameter; what each sent."""
    out = WeightSender(ctx, verify_every=1)
    out.bind(module)
    sent = []
    for step in range(versions):
        with torch.no_grad():
            for p in module.parameters():
                p.add_(step + 1)
        out.send(module if whole_module else module.state_dict())
        sent.append(snapshot(module.state_dict()))
    return sent


def _double_buffered(rank: int, world_size: int) -> Any:
    with weight_groups([[0, 1]]) as ctx:
        module = make_trainable(seed=rank)
        if rank == 0:
            return _send_stepped(ctx, module, 3, whole_module=False)
        inp = WeightReceiver(ctx, expected=module.state_dict())
        inp.bind(module)
        assert inp.receive_into(module) == 1
        acting = snapshot(module.state_dict())
        pointers = [p.data_ptr() for p in module.parameters()]
        inp.post()
        inp.post()
        deadline = time.monotonic() + 30
        while not inp.ready():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert inp.receive()[0] == 2  # completes it without touching the module
        while not inp.ready():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # Versions 2 and 3 have arrived in spare buffers; the module still acts with version 1.
        unchanged = snapshot(module.state_dict()) == acting
        loaded = inp.load(module)  # a segment boundary: the newest arrived version swaps in
        moved = [p.data_ptr() for p in module.parameters()] != pointers
        return {"unchanged": unchanged, "loaded": loaded, "moved": moved,
                "first": acting, "final": snapshot(module.state_dict())}


@pytest.mark.integration
def test_posted_receives_land_beside_the_acting_weights_and_swap_at_load() -> None:
    results = run_ranks(_double_buffered, 2, timeout=TIMEOUT_S)
    sent, got = results[0], results[1]
    assert got["unchanged"] and got["moved"] and got["loaded"] == 3
    assert mismatches(restore(got["first"]), restore(sent[0])) == []
    assert mismatches(restore(got["final"]), restore(sent[2])) == []


def _in_place(rank: int, world_size: int) -> Any:
    with weight_groups([[0, 1]]) as ctx:
        module = make_trainable(seed=rank)
        if rank == 0:
            return _send_stepped(ctx, module, 3, whole_module=True)
        inp = WeightReceiver(ctx, expected=module.state_dict())
        inp.bind(module)
        got, pointers = [], []
        for _ in range(3):
            got.append((inp.receive_into(module), snapshot(module.state_dict())))
            pointers.append([p.data_ptr() for p in module.parameters()])
        return {"got": got, "pointers": pointers}


@pytest.mark.integration
def test_a_bound_module_receives_in_place_and_verified() -> None:
    # Lockstep PPO's path: after the first version the module keeps its memory (no second
    # buffer, no swap), every version is the sender's, and each was checksummed and verified.
    results = run_ranks(_in_place, 2, timeout=TIMEOUT_S)
    sent, got = results[0], results[1]
    assert [v for v, _ in got["got"]] == [1, 2, 3]
    for (_, state), want in zip(got["got"], sent):
        assert mismatches(restore(state), restore(want)) == []
    assert got["pointers"][0] == got["pointers"][1] == got["pointers"][2]


def _ddp_bound(rank: int, world_size: int) -> Any:
    # Trainers 0,1 under DDP, each sending to its receiver (0 -> 2, 1 -> 3).
    with weight_groups([[0, 2], [1, 3]]) as ctx:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        if rank >= 2:
            inp = WeightReceiver(ctx, expected=module.state_dict())
            inp.bind(module)
            return [(inp.receive_into(module), snapshot(module.state_dict())) for _ in range(3)]
        ctx.init_group([0, 1], TDP, backend="gloo")
        out = WeightSender(ctx, verify_every=1)
        out.bind(module)  # before DDP wraps it
        ddp = DistributedDataParallel(module, process_group=ctx.get_group(TDP))
        optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
        sent, copied = [], []
        out.send(module)  # PPO's call: the bound module itself
        sent.append(snapshot(module.state_dict()))
        gen = torch.Generator().manual_seed(rank)  # different data: DDP must average
        optimizer.zero_grad()
        ddp(torch.randn(8, 6, generator=gen)).square().mean().backward()
        optimizer.step()
        out.send(module)
        sent.append(snapshot(module.state_dict()))
        copied.append(out._copied)
        weight = module[0].weight  # replacing .data breaks that tensor's binding: copied again
        weight.data = weight.data.clone() * 2
        out.send(module)
        sent.append(snapshot(module.state_dict()))
        copied.append(out._copied)
        return {"sent": sent, "copied": copied}


@pytest.mark.integration
def test_the_bound_sender_under_ddp_delivers_the_stepped_weights() -> None:
    results = run_ranks(_ddp_bound, 4, timeout=TIMEOUT_S)
    for trainer, receiver in ((0, 2), (1, 3)):
        sent, got = results[trainer]["sent"], results[receiver]
        # Still bound after DDP and an optimizer step; one tensor copied once its .data changed.
        assert results[trainer]["copied"] == [0, 1]
        assert [v for v, _ in got] == [1, 2, 3]
        for (_, state), want in zip(got, sent):
            assert mismatches(restore(state), restore(want)) == []
        assert mismatches(restore(sent[0]), restore(sent[1]))  # the step changed the weights
    # DDP kept the trainers identical.
    assert mismatches(restore(results[0]["sent"][1]), restore(results[1]["sent"][1])) == []


def _dtype_change(rank: int, world_size: int) -> str:
    with weight_groups([[0, 1]]) as ctx:
        torch.manual_seed(0)
        module = nn.Linear(4, 2)
        if rank == 0:
            module.to(torch.float64)
            with contextlib.suppress(WeightTransferError):
                WeightSender(ctx).send(module.state_dict())
            return ""
        inp = WeightReceiver(ctx)
        inp.bind(module)  # the module's layout becomes the expected one
        try:
            inp.receive_into(module)
        except WeightTransferError as err:
            return str(err)
        return "no error"


@pytest.mark.integration
def test_a_bound_receiver_rejects_a_dtype_change_naming_the_tensor() -> None:
    error = run_ranks(_dtype_change, 2, timeout=TIMEOUT_S)[1]
    assert "'weight' is [2, 4] float64 but expected [2, 4] float32" in error, error
