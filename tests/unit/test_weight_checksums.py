"""Weights proven identical, in this process: the checksum sees any single byte, batched
checksums equal each tensor's own, and a large buffer is summed by two threads only where the
process declared two (rlcomm/weights/checksums.py). Between real gloo processes:
tests/integration/test_weight_async.py."""

from __future__ import annotations

import pytest
import torch

from rlcomm.weights import describe_state_dict, tensor_checksum
from rlcomm.weights.buffers import FlatBuffers as _FlatBuffers
from rlcomm.weights.checksums import THREAD_NAME, ChecksumHelper
from tests.helpers.checksum_threads import declared_threads, helper_threads

pytestmark = pytest.mark.unit


def test_checksum_sees_any_single_byte() -> None:
    tensor = torch.randn(37, dtype=torch.float32)
    base = tensor_checksum(tensor)
    raw = tensor.view(torch.uint8)
    for index in (0, 7, 8, 100, raw.numel() - 1):  # in the 8-byte words and in the tail
        changed = tensor.clone()
        changed.view(torch.uint8)[index] ^= 1
        assert tensor_checksum(changed) != base, index
    # An unaligned view (offset 4 bytes in its storage) gives the same checksum as a copy.
    storage = torch.randn(39)
    assert tensor_checksum(storage[1:38]) == tensor_checksum(storage[1:38].clone())


def test_batched_checksums_equal_each_tensors_own() -> None:
    # Odd sizes and mixed dtypes: tails after the 8-byte words and views not 8-byte aligned.
    state = {
        "a": torch.randn(37),
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "c": torch.randint(0, 2, (7,), dtype=torch.bool),
        "d": torch.randn(0),
        "e": torch.arange(11, dtype=torch.int16),
        "f": torch.randn(2, 2, dtype=torch.float64),
        "g": torch.randn(5).to(torch.bfloat16),  # starts 30 bytes into the bfloat16 segment
    }
    buffers = _FlatBuffers(describe_state_dict(state), torch.device("cpu"))
    buffers.pack(state)
    batched = buffers.view_checksums().tolist()
    assert batched == [tensor_checksum(t) for t in state.values()]
    buffers.views["b"].view(torch.uint8)[-1] ^= 1  # one byte of one tensor: only its entry moves
    after = buffers.view_checksums().tolist()
    assert [x != y for x, y in zip(batched, after)] == [False, True, False, False, False, False, False]


def large_state() -> dict[str, torch.Tensor]:
    """Over 1 MiB of mixed dtypes: big enough for the two-thread checksum path."""
    return {f"t{i}": torch.randn(40_000 + 3 * i).to(torch.bfloat16 if i % 2 else torch.float32)
            for i in range(9)}


def test_checksums_of_a_large_buffer_summed_by_two_threads_equal_each_tensors_own() -> None:
    # Over 1 MiB: the tensors are summed in two halves, one by a helper thread.
    state = large_state()
    buffers = _FlatBuffers(describe_state_dict(state), torch.device("cpu"))
    assert buffers.wire.nbytes > 1 << 20
    buffers.pack(state)
    with declared_threads(2):  # the process allows two threads
        assert buffers.view_checksums().tolist() == [tensor_checksum(t) for t in state.values()]
    assert helper_threads() == []  # without a caller's helper, one lived for that call only


def test_a_process_that_declared_one_thread_starts_no_checksum_helper() -> None:
    # PPO's ranks (torch.set_num_threads(1)) stay on their one core, even for a large buffer.
    state = large_state()
    buffers = _FlatBuffers(describe_state_dict(state), torch.device("cpu"))
    buffers.pack(state)
    want = [tensor_checksum(t) for t in state.values()]
    with declared_threads(1), ChecksumHelper() as helper:
        assert buffers.view_checksums(helper).tolist() == want
        assert buffers.view_checksums().tolist() == want
        assert helper_threads() == []


def test_two_declared_threads_sum_with_the_owned_helper_until_it_is_closed() -> None:
    state = large_state()
    buffers = _FlatBuffers(describe_state_dict(state), torch.device("cpu"))
    buffers.pack(state)
    want = [tensor_checksum(t) for t in state.values()]
    with declared_threads(2):
        helper = ChecksumHelper()
        try:
            assert helper_threads() == []  # started on first use, not before
            assert buffers.view_checksums(helper).tolist() == want
            assert helper_threads() == [f"{THREAD_NAME}_0"]  # the two-thread path was taken
            assert buffers.view_checksums(helper).tolist() == want  # the same thread again
            assert helper_threads() == [f"{THREAD_NAME}_0"]
        finally:
            helper.close()
        assert helper_threads() == []
        small = {"a": torch.randn(37)}  # under 1 MiB: one thread, no helper
        flat = _FlatBuffers(describe_state_dict(small), torch.device("cpu"))
        flat.pack(small)
        assert flat.view_checksums(helper).tolist() == [tensor_checksum(small["a"])]
        assert helper_threads() == []
