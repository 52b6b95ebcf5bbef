"""Weight transfer between real gloo processes: bit-exact, persistent buffers, no hangs. Its
metadata, in this process, is tests/unit/test_weight_metadata.py."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from rlcomm import CommContext, ParallelMode
from rlcomm.testing import run_ranks
from rlcomm.weights import (
    WeightReceiver,
    WeightSender,
    WeightTransferError,
)
from tests.helpers.weights import (
    TIMEOUT_S,
    make_trainable,
    mismatches,
    restore,
    snapshot,
    weight_groups,
)

WT = ParallelMode.WEIGHT_TRANSFER


def random_bits(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Random bit patterns (NaNs, infs, denormals included): only bit-exact copies survive."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def make_weights(step: int, seed: int = 0, extra: bool = False) -> dict[str, Tensor]:
    """A state dict both ends can rebuild from (step, seed): every dtype and awkward shape."""
    gen = torch.Generator().manual_seed(1000 * seed + step)
    weights = {
        "fp32": random_bits(gen, (7, 13), torch.float32),
        "bf16": random_bits(gen, (5, 3), torch.bfloat16),
        "fp16": random_bits(gen, (11,), torch.float16),
        "int64": random_bits(gen, (3, 2), torch.int64),
        "int32": random_bits(gen, (3, 3), torch.int32),
        "uint8": random_bits(gen, (13,), torch.uint8),
        "bool": random_bits(gen, (4, 5), torch.bool),
        "transposed": random_bits(gen, (13, 7), torch.float32).t(),  # non-contiguous
        "empty": torch.empty(0, 4),
        "scalar": random_bits(gen, (), torch.float64),
        "bf16_tail": random_bits(gen, (1,), torch.bfloat16),
    }
    if extra:
        weights["added"] = random_bits(gen, (2, 9), torch.float16)
    return weights


def send_or_check(ctx: CommContext, steps: int, seed: int | None = None) -> list[Any]:
    """Sender sends ``steps`` versions; receivers compare each against the rebuilt original."""
    sender = ctx.get_declared_ranks(WT)[0]
    seed = sender if seed is None else seed
    if ctx.get_global_rank() == sender:
        out = WeightSender(ctx)
        return [out.send(make_weights(step, seed)) for step in range(steps)]
    inp = WeightReceiver(ctx)
    results = []
    for step in range(steps):
        version, state = inp.receive()
        results.append((version, mismatches(state, make_weights(step, seed))))
    return results


def _round_trip(rank: int, world_size: int, groups: list[list[int]]) -> list[Any] | None:
    with weight_groups(groups) as ctx:
        if rank not in {r for group in groups for r in group}:
            return None
        return send_or_check(ctx, steps=3)


@pytest.mark.integration
def test_every_dtype_round_trips_bit_exact_over_three_versions() -> None:
    results = run_ranks(_round_trip, 2, [[0, 1]], timeout=TIMEOUT_S)
    assert results[0] == [1, 2, 3]
    assert results[1] == [(1, []), (2, []), (3, [])]


@pytest.mark.integration
def test_one_sender_three_receivers() -> None:
    results = run_ranks(_round_trip, 4, [[0, 1, 2, 3]], timeout=TIMEOUT_S)
    assert results[0] == [1, 2, 3]
    for rank in (1, 2, 3):
        assert results[rank] == [(1, []), (2, []), (3, [])]


def _two_groups(rank: int, world_size: int) -> list[Any]:
    with weight_groups([[0, 2], [1, 3]]) as ctx:
        # Each trainer sends different weights (seeded by its rank); receivers check theirs.
        return send_or_check(ctx, steps=2)


@pytest.mark.integration
def test_two_groups_transfer_at_once() -> None:
    results = run_ranks(_two_groups, 4, timeout=TIMEOUT_S)
    assert results[0] == results[1] == [1, 2]
    assert results[2] == results[3] == [(1, []), (2, [])]
    assert mismatches(make_weights(0, seed=0), make_weights(0, seed=1))  # really different


@pytest.mark.integration
def test_sender_with_a_higher_global_rank_than_its_receivers() -> None:
    results = run_ranks(_round_trip, 4, [[3, 0, 1]], timeout=TIMEOUT_S)
    assert results[3] == [1, 2, 3]
    assert results[0] == results[1] == [(1, []), (2, []), (3, [])]
    assert results[2] is None


def make_module(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Linear(13, 3))
    module.to(torch.bfloat16)
    module[0].to(torch.float32)  # mixed dtypes, plus BatchNorm's int64 counter
    return module


def _receive_into(rank: int, world_size: int) -> list[str]:
    with weight_groups([[0, 1]]) as ctx:
        if rank == 0:
            WeightSender(ctx).send(make_module(seed=1).state_dict())
            return []
        module = make_module(seed=2)
        assert WeightReceiver(ctx).receive_into(module) == 1
        return mismatches(module.state_dict(), make_module(seed=1).state_dict())


@pytest.mark.integration
def test_receive_into_loads_identical_parameters() -> None:
    assert mismatches(make_module(1).state_dict(), make_module(2).state_dict())
    assert run_ranks(_receive_into, 2, timeout=TIMEOUT_S)[1] == []


def _buffers_reused(rank: int, world_size: int) -> list[Any]:
    with weight_groups([[0, 1]]) as ctx:
        if rank == 0:
            out = WeightSender(ctx)
            ptrs = []
            for step in range(3):
                out.send(make_weights(step))
                assert out._buffers is not None
                ptrs.append([b.data_ptr() for b in out._buffers.buffers.values()])
            return ptrs
        inp = WeightReceiver(ctx)
        ptrs = []
        for _ in range(3):
            _, state = inp.receive()
            ptrs.append([state[name].data_ptr() for name in ("fp32", "bf16", "bool")])
        return ptrs


@pytest.mark.integration
def test_persistent_buffers_are_reused_across_transfers() -> None:
    results = run_ranks(_buffers_reused, 2, timeout=TIMEOUT_S)
    for ptrs in results.values():
        assert ptrs[0] == ptrs[1] == ptrs[2]


def _metadata_change(rank: int, world_size: int) -> list[Any]:
    with weight_groups([[0, 1]]) as ctx:
        plan = [False, True, True]  # the second send adds a tensor
        if rank == 0:
            out = WeightSender(ctx)
            return [out.send(make_weights(step, extra=extra)) for step, extra in enumerate(plan)]
        inp = WeightReceiver(ctx)
        results = []
        for step, extra in enumerate(plan):
            version, state = inp.receive()
            results.append((version, mismatches(state, make_weights(step, extra=extra))))
        return results


@pytest.mark.integration
def test_metadata_change_is_picked_up_on_the_next_send() -> None:
    results = run_ranks(_metadata_change, 2, timeout=TIMEOUT_S)
    assert results[0] == [1, 2, 3]
    assert results[1] == [(1, []), (2, []), (3, [])]


def _rejected(rank: int, world_size: int) -> dict[str, Any]:
    with weight_groups([[0, 1, 2]]) as ctx:
        weights = make_weights(0)
        expected = dict(weights)
        if rank == 2:
            expected["fp32"] = torch.zeros(7, 14)
        try:
            if rank == 0:
                WeightSender(ctx).send(weights)
            else:
                WeightReceiver(ctx, expected=expected).receive()
        except WeightTransferError as err:
            return {"error": str(err)}
        return {"error": None}


@pytest.mark.integration
def test_expected_mismatch_fails_the_receiver_and_the_sender() -> None:
    results = run_ranks(_rejected, 3, timeout=TIMEOUT_S)
    receiver = results[2]["error"]
    assert "rank 2 rejected" in receiver and "'fp32'" in receiver
    assert "[7, 13] float32" in receiver and "[7, 14] float32" in receiver
    assert "receiver rank(s) 2 rejected" in results[0]["error"]
    assert "rank(s) 2 rejected" in results[1]["error"]  # the accepting receiver is not left waiting


def _aborted(rank: int, world_size: int) -> list[str]:
    with weight_groups([[0, 1]]) as ctx:
        errors = []
        if rank == 0:
            out = WeightSender(ctx)
            try:
                out.send({"w": torch.ones(3), "step": 7})  # type: ignore[dict-item]
            except WeightTransferError as err:
                errors.append(str(err))
            errors.append(str(out.send({"w": torch.ones(3)})))  # the group is still usable
            return errors
        inp = WeightReceiver(ctx)
        try:
            inp.receive()
        except WeightTransferError as err:
            errors.append(str(err))
        version, state = inp.receive()
        errors.append(f"{version} {state['w'].tolist()}")
        return errors


@pytest.mark.integration
def test_a_sender_that_cannot_pack_fails_its_receivers_without_a_hang() -> None:
    results = run_ranks(_aborted, 2, timeout=TIMEOUT_S)
    assert "'step' is of type int" in results[0][0] and results[0][1] == "1"
    assert "sender rank 0 aborted" in results[1][0] and results[1][1] == "1 [1.0, 1.0, 1.0]"


def _async_send(rank: int, world_size: int) -> list[Any]:
    with weight_groups([[0, 1]]) as ctx:
        if rank == 0:
            out = WeightSender(ctx)
            versions = [out.send(make_weights(step), wait=False) for step in range(3)]
            out.wait()
            return [*versions, out.version]
        return send_or_check(ctx, steps=3, seed=0)


@pytest.mark.integration
def test_send_without_waiting_then_wait() -> None:
    results = run_ranks(_async_send, 2, timeout=TIMEOUT_S)
    assert results[0] == [1, 2, 3, 3]
    assert results[1] == [(1, []), (2, []), (3, [])]


def _wrong_roles(rank: int, world_size: int) -> str:
    with weight_groups([[1, 0]]) as ctx:
        role: Callable[[CommContext], object] = WeightReceiver if rank == 1 else WeightSender
        try:
            role(ctx)
        except WeightTransferError as err:
            return str(err)
        return "no error"


@pytest.mark.integration
def test_sender_must_be_the_first_declared_rank() -> None:
    results = run_ranks(_wrong_roles, 2, timeout=TIMEOUT_S)
    assert "rank 1 cannot be a WeightReceiver in WEIGHT_TRANSFER[1,0]" in results[1]
    assert "rank 0 cannot be a WeightSender" in results[0]
    assert "rank 1 (its first declared rank) sends" in results[0]


@contextmanager
def counting_copies() -> Iterator[list[int]]:
    """Record how many tensors each ``torch._foreach_copy_`` call (the sender's pack) copies."""
    counts: list[int] = []
    original = torch._foreach_copy_

    def counted(targets: list[Tensor], sources: list[Tensor], *args: Any, **kwargs: Any) -> None:
        counts.append(len(targets))
        original(targets, sources, *args, **kwargs)

    torch._foreach_copy_ = counted  # type: ignore[assignment]
    try:
        yield counts
    finally:
        torch._foreach_copy_ = original


def bound_tensors(module: nn.Module, sender: WeightSender) -> list[str]:
    """Names of the module's parameters and buffers that are their send-buffer views."""
    if sender._buffers is None:
        return []
    views = sender._buffers.views
    named = [*module.named_parameters(), *module.named_buffers()]
    return [
        name
        for name, tensor in named
        if tensor.data_ptr() == views[name].data_ptr() and tensor.stride() == views[name].stride()
    ]


def _bound(rank: int, world_size: int) -> dict[str, Any]:
    with weight_groups([[0, 1, 2]]) as ctx:
        steps = 5
        if rank != 0:
            inp = WeightReceiver(ctx)
            received = []
            for _ in range(steps):
                version, state = inp.receive()
                received.append((version, snapshot(state)))
            return {"received": received}
        module = make_trainable(seed=1)
        out = WeightSender(ctx)
        optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(0)
        names = list(module.state_dict())
        sent, copies, bound = [], [], []
        with counting_copies() as counts:
            for step in range(steps):
                if step == 1:  # bind after a plain send: the same buffers, now zero-copy
                    ptrs = [b.data_ptr() for b in out._buffers.buffers.values()]  # type: ignore[union-attr]
                    out.bind(module)
                    assert ptrs == [b.data_ptr() for b in out._buffers.buffers.values()]  # type: ignore[union-attr]
                elif step == 2:
                    with torch.no_grad():
                        for tensor in [*module.parameters(), *module.buffers()]:
                            tensor.add_(1)
                elif step == 3:
                    for _ in range(2):
                        optimizer.zero_grad()
                        module(torch.randn(16, 7, generator=gen)).square().mean().backward()
                        optimizer.step()
                elif step == 4:  # breaks the binding of one tensor: copied again, still right
                    weight = module[0].weight
                    weight.data = weight.data.clone() * 2
                bound.append(len(bound_tensors(module, out)))
                counts.clear()
                version = out.send(module.state_dict())
                copies.append(sum(counts))
                sent.append((version, snapshot(module.state_dict())))
        return {"sent": sent, "copies": copies, "bound": bound, "names": names}


@pytest.mark.integration
def test_a_bound_module_is_sent_without_copies_and_bit_exact() -> None:
    results = run_ranks(_bound, 3, timeout=TIMEOUT_S)
    sender = results[0]
    total = len(sender["names"])  # 6 parameters, 4 buffers: all in the state dict, none empty
    assert total == 10
    # Before bind every tensor is copied; bound, none; with one `.data` replaced, that one.
    assert sender["copies"] == [total, 0, 0, 0, 1]
    assert sender["bound"] == [0, total, total, total, total - 1]
    assert [v for v, _ in sender["sent"]] == [1, 2, 3, 4, 5]
    for receiver in (1, 2):
        received = results[receiver]["received"]
        assert [v for v, _ in received] == [1, 2, 3, 4, 5]
        for (_, got), (_, want) in zip(received, sender["sent"]):
            assert mismatches(restore(got), restore(want)) == []
    # The in-place updates really changed the weights between versions.
    states = [restore(state) for _, state in sender["sent"]]
    for before, after in itertools.pairwise(states[1:]):
        assert mismatches(before, after)


def _unbound_copies(rank: int, world_size: int) -> list[Any]:
    with weight_groups([[0, 1]]) as ctx:
        if rank != 0:
            return send_or_check(ctx, steps=3)
        out = WeightSender(ctx)
        copied = []
        with counting_copies() as counts:
            for step in range(3):
                counts.clear()
                out.send(make_weights(step, seed=0))
                copied.append(sum(counts))
        return copied


@pytest.mark.integration
def test_an_unbound_sender_copies_every_tensor_every_time() -> None:
    results = run_ranks(_unbound_copies, 2, timeout=TIMEOUT_S)
    nonempty = sum(t.numel() > 0 for t in make_weights(0).values())  # empty: nothing to copy
    assert results[0] == [nonempty] * 3
    assert results[1] == [(1, []), (2, []), (3, [])]


def _bind_wrong_device(rank: int, world_size: int) -> str:
    with weight_groups([[0, 1]]) as ctx:
        if rank != 0:
            return ""
        out = WeightSender(ctx, device="meta")
        try:
            out.bind(make_trainable(seed=0))
        except WeightTransferError as err:
            return str(err)
        return "no error"


@pytest.mark.integration
def test_bind_refuses_a_module_on_another_device() -> None:
    assert "cannot bind" in run_ranks(_bind_wrong_device, 2, timeout=TIMEOUT_S)[0]


def _failures_after_a_layout(rank: int, world_size: int) -> list[Any]:
    """Once the receivers hold a layout the header travels in its buffer: an abort and a rejected
    change there must leave every member in step for the next good version."""
    with weight_groups([[0, 1, 2]]) as ctx:
        results: list[Any] = []
        if rank == 0:
            out = WeightSender(ctx)
            results.append(out.send(make_weights(0)))
            for bad in ({"fp32": "no"}, make_weights(1, extra=True)):
                try:
                    out.send(bad)  # type: ignore[arg-type]
                except WeightTransferError as err:
                    results.append(str(err).split(":")[-1].strip()[:20])
            results.append(out.send(make_weights(2)))
            return results
        inp = WeightReceiver(ctx, expected=make_weights(0))
        version, state = inp.receive()
        results.append((version, mismatches(state, make_weights(0))))
        for _ in range(2):
            try:
                inp.receive()
                results.append("no error")
            except WeightTransferError as err:
                results.append("aborted" if "aborted" in str(err) else "rejected")
        version, state = inp.receive()
        results.append((version, mismatches(state, make_weights(2))))
        return results


@pytest.mark.integration
def test_abort_and_rejection_after_the_first_version_keep_the_group_in_step() -> None:
    results = run_ranks(_failures_after_a_layout, 3, timeout=TIMEOUT_S)
    # Neither failure uses up a version number.
    assert results[0][0] == 1 and results[0][-1] == 2 and len(results[0]) == 4
    for rank in (1, 2):
        assert results[rank] == [(1, []), "aborted", "rejected", (2, [])]
