"""A steady sender's key in the weights metadata, in this process (rlcomm/weights/protocol.py):
it round-trips, a plain sender's document has none (the same bytes as without the option), and
a malformed one is rejected naming it. Transfers: tests/integration/test_weight_steady.py."""

from __future__ import annotations

import json

import pytest
import torch

from rlcomm.weights import (
    TensorMeta,
    WeightTransferError,
    decode_document,
    decode_metadata,
    encode_metadata,
)

pytestmark = pytest.mark.unit

METADATA = (TensorMeta("w", torch.float32, (4, 2)), TensorMeta("e", torch.int8, (0,)))


@pytest.mark.parametrize("every", [0, 1, 7])
def test_a_steady_senders_schedule_round_trips(every: int) -> None:
    raw = encode_metadata(METADATA, steady=every)
    assert json.loads(raw)["steady"] == {"verify_every": every}
    assert decode_document(raw) == (METADATA, every)
    assert decode_metadata(raw) == METADATA


def test_a_plain_senders_metadata_has_no_steady_key() -> None:
    raw = encode_metadata(METADATA)
    assert "steady" not in json.loads(raw)
    assert decode_document(raw) == (METADATA, None)


@pytest.mark.parametrize("steady", [
    {"verify_every": -1}, {"verify_every": True}, {"verify_every": 1.0}, {"verify_every": "2"},
    {}, {"verify_every": 2, "more": 1}, [2], 2, None,
])
def test_a_malformed_steady_key_is_rejected(steady: object) -> None:
    document = json.loads(encode_metadata(METADATA))
    document["steady"] = steady
    raw = json.dumps(document).encode()
    with pytest.raises(WeightTransferError, match="weights metadata 'steady'"):
        decode_document(raw)
    with pytest.raises(WeightTransferError, match="weights metadata 'steady'"):
        decode_metadata(raw)
