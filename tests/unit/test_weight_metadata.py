"""Weight transfer's metadata, in this process (rlcomm/weights): it round-trips as JSON, a
malformed one is rejected, and mismatches name the tensor and both sides; rlcomm hands on
rlcomm.weights' classes. Transfers between real gloo processes are
tests/integration/test_weight_transfer.py."""

from __future__ import annotations

import pytest
import torch

from rlcomm.weights import (
    TensorMeta,
    WeightTransferError,
    decode_metadata,
    encode_metadata,
    metadata_mismatches,
)

pytestmark = pytest.mark.unit


def test_metadata_round_trips_as_json() -> None:
    metadata = (
        TensorMeta("a", torch.bfloat16, (2, 3)),
        TensorMeta("b", torch.bool, ()),
        TensorMeta("c", torch.bfloat16, (0, 5)),
    )
    raw = encode_metadata(metadata)
    assert raw.startswith(b"{") and decode_metadata(raw) == metadata


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x80not json", "not valid JSON"),
        (b'{"format":"pickle","tensors":[],"buffers":{}}', "format"),
        (b'{"format":"rlcomm.weights/1","tensors":[["a","object",[1]]],"buffers":{}}',
         "unknown dtype 'object'"),
        (b'{"format":"rlcomm.weights/1","tensors":[["a","float32",[-1]]],"buffers":{}}',
         "invalid shape [-1]"),
        (b'{"format":"rlcomm.weights/1","tensors":[["a","float32",[true]]],"buffers":{}}',
         "invalid shape [True]"),
        (b'{"format":"rlcomm.weights/1","tensors":[["a","float32",[2]]],'
         b'"buffers":{"float32":3}}', "do not add up"),
        (b'{"format":"rlcomm.weights/1","tensors":[["a","int8",[]],["a","int8",[]]],'
         b'"buffers":{"int8":2}}', "'a' twice"),
    ],
)
def test_malformed_metadata_is_rejected(raw: bytes, message: str) -> None:
    with pytest.raises(WeightTransferError, match=message.replace("[", r"\[")):
        decode_metadata(raw)


def test_mismatches_name_the_tensor_and_both_sides() -> None:
    metadata = (TensorMeta("w", torch.float32, (2, 3)), TensorMeta("extra", torch.int8, (1,)))
    problems = metadata_mismatches(
        metadata, {"w": torch.zeros(2, 3, dtype=torch.float16), "gone": torch.zeros(1)}
    )
    assert problems == [
        "missing tensor 'gone'",
        "tensor 'w' is [2, 3] float32 but expected [2, 3] float16",
        "unexpected tensor 'extra' ([1] int8)",
    ]


def test_rlcomm_hands_on_the_weights_classes_of_rlcomm_weights() -> None:
    import rlcomm
    import rlcomm.weights as weights

    assert rlcomm.WeightSender is weights.WeightSender
    assert rlcomm.WeightReceiver is weights.WeightReceiver
