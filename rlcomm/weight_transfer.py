"""Compatible alias of :mod:`rlcomm.weights`, kept for code that imports from here.

``from rlcomm.weight_transfer import WeightSender, WeightReceiver`` goes on working: this module
only re-exports the public names of :mod:`rlcomm.weights`, where the code and the wire protocol
now live. New code imports from :mod:`rlcomm.weights`.
"""

from rlcomm.weights import (
    METADATA_FORMAT,
    Metadata,
    TensorMeta,
    WeightReceiver,
    WeightSender,
    WeightTransferError,
    decode_metadata,
    describe_state_dict,
    encode_metadata,
    metadata_mismatches,
    tensor_checksum,
)

__all__ = [
    "METADATA_FORMAT",
    "Metadata",
    "TensorMeta",
    "WeightReceiver",
    "WeightSender",
    "WeightTransferError",
    "decode_metadata",
    "describe_state_dict",
    "encode_metadata",
    "metadata_mismatches",
    "tensor_checksum",
]
