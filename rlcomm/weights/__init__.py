"""Trainer -> rollout weight transfer over a WEIGHT_TRANSFER group.

The group's first declared rank (the trainer) runs a :class:`WeightSender`, every other member a
:class:`WeightReceiver`; a state dict crosses bit-exactly in one broadcast of persistent flat
buffers. The wire protocol is described in :mod:`rlcomm.weights.protocol`; the buffers live in
:mod:`~rlcomm.weights.buffers`, the checksums that verify a version in
:mod:`~rlcomm.weights.checksums`, the two ends in :mod:`~rlcomm.weights.sender` and
:mod:`~rlcomm.weights.receiver`.
"""

from .checksums import tensor_checksum
from .protocol import (
    METADATA_FORMAT,
    Metadata,
    TensorMeta,
    TransfersEnded,
    WeightTransferError,
    decode_document,
    decode_metadata,
    describe_state_dict,
    encode_metadata,
    metadata_mismatches,
)
from .receiver import WeightReceiver
from .sender import WeightSender

__all__ = [
    "METADATA_FORMAT",
    "Metadata",
    "TensorMeta",
    "TransfersEnded",
    "WeightReceiver",
    "WeightSender",
    "WeightTransferError",
    "decode_document",
    "decode_metadata",
    "describe_state_dict",
    "encode_metadata",
    "metadata_mismatches",
    "tensor_checksum",
]
