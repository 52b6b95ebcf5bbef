"""The wire protocol of a weight transfer, and the metadata that describes a state dict.

The group's first declared rank (the trainer) sends, every other member receives. Tensors are
grouped by dtype into one persistent flat buffer per dtype, all of them segments of one
allocation whose bytes go out as a single ``broadcast``, so every dtype crosses any backend
bit-exactly and the buffers are allocated once, not once per transfer.

Wire protocol, per transfer (plain tensors only; nothing is pickled). The data goes out as one
uint8 buffer: a 64-byte slot for the header, then every dtype's values in a segment of its own,
in the order the metadata lists the dtypes, each starting at a multiple of 64 bytes.

1. an int64 header ``[version, metadata_flag, metadata_len, checksummed]``. Before any metadata
   was accepted it is broadcast alone; after that it travels in the header slot of the buffer of
   the metadata the receivers hold, so a transfer whose metadata is unchanged is a single
   broadcast (the header and the data together) and nothing follows;
2. when the flag is ``1`` (the names, dtypes or shapes changed, always on the first transfer):
   the metadata as UTF-8 JSON in a uint8 tensor, then an all_reduce of one reject flag per group
   member, so a rejected transfer fails on every member instead of leaving anyone waiting, then
   the data in a buffer of the new metadata;
3. after the data, each *direct* tensor in a broadcast of its own, in metadata order, straight
   from the sender's tensor into the receiver's: the names both ends were given
   (``WeightSender(direct=...)``, ``WeightReceiver(direct=...)``; none by default) that are not
   empty. They have no place in the buffers (their checksums do); only a header that carries a
   version is followed by them;
4. a *steady* sender (``WeightSender(steady=True)``) says so in its metadata, and after that
   metadata was accepted its *routine* versions go out as step 3 alone: no header, no buffer.
   A version is routine when it carries no checksum by the sender's ``verify_every`` schedule
   (``version % verify_every``, never with 0) and every tensor with bytes is direct (the buffers
   hold no data). The receivers predict which versions are routine from the version they expect
   next (one after the last), the schedule and the metadata, and give them that version number
   themselves; every other version goes out as steps 1-3. What it cannot signal without a
   header, a steady sender refuses before sending anything (the receivers see nothing of it):
   ``verify=True`` on a version that would be routine, a change of names, dtypes or shapes
   after its first transfer, and ending its transfers (flags ``-2``/``-3``). A state dict it
   cannot pack on a version that would be routine is not announced either (flag ``-1`` needs a
   header): its receivers wait for that version, which the next send that succeeds delivers
   (else they fail at the group's timeout).

When the header rides in a buffer whose flag is not ``0``, that buffer's data is not a version:
receivers ignore it (their views of the last version are overwritten, as by any receive).

A flag of ``-1`` means the sender could not pack its state dict: receivers raise, nothing follows.

Verification: after the dtype segments every buffer has a segment of one int64 per tensor. When a
sender verifies a version (``verify_every``), it writes each tensor's checksum of its exact bytes
there and sets ``checksummed``; a receiver that loads that version into a module recomputes the
checksums from the module's tensors and raises, naming the first tensor that differs.

The metadata is ``{"format": "rlcomm.weights/1", "tensors": [[name, dtype, shape], ...],
"buffers": {dtype: elements, ...}}``, tensors in state-dict order, ``buffers`` in order of each
dtype's first appearance (the order of the segments); a steady sender's adds
``"steady": {"verify_every": N}`` (its schedule, ``N >= 0``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlcomm.errors import RlcommError

METADATA_FORMAT = "rlcomm.weights/1"

# Header flags (the header's second entry).
SAME_METADATA = 0
NEW_METADATA = 1
SENDER_ABORTED = -1
# The sender ends its transfers on this group (no data follows): the run stopped, or the group
# was replaced by a new membership epoch (rlcomm.elastic).
SENDER_STOPPED = -2
SENDER_MOVED = -3

ALIGN = 64  # bytes; every dtype's segment of the wire starts at a multiple of this
HEADER_SLOT = ALIGN  # bytes before the first segment: the header (4 int64) and padding
HEADER_LEN = 4  # [version, metadata_flag, metadata_len, checksummed]

# Names accepted on the wire; anything else in received metadata is rejected.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "complex64",
        "complex128",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint64",
        "uint32",
        "uint16",
        "uint8",
        "bool",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class TransfersEnded(RlcommError):
    """The sender ended its transfers on this group: ``moved`` (a new membership epoch replaces
    the group) or not (the run stopped). Not an error: the receiver's caller decides."""

    def __init__(self, message: str, moved: bool) -> None:
        super().__init__(message)
        self.moved = moved


class WeightTransferError(RlcommError, RuntimeError):
    """A weight transfer that cannot proceed: wrong role, bad metadata, rejected or aborted."""


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to know about one tensor: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        return f"{list(self.shape)} {DTYPE_NAMES.get(self.dtype, str(self.dtype))}"


Metadata = tuple[TensorMeta, ...]


def describe_state_dict(state_dict: Mapping[str, Tensor]) -> Metadata:
    """The metadata of ``state_dict`` in its order; non-tensors and unknown dtypes are errors."""
    metas = []
    for name, tensor in state_dict.items():
        if not isinstance(tensor, Tensor):
            raise WeightTransferError(
                f"state dict entry {name!r} is of type {type(tensor).__name__}, not a tensor"
            )
        if tensor.dtype not in DTYPE_NAMES:
            raise WeightTransferError(
                f"state dict entry {name!r} has unsupported dtype {tensor.dtype}; "
                f"supported: {', '.join(DTYPES)}"
            )
        metas.append(TensorMeta(str(name), tensor.dtype, tuple(tensor.shape)))
    return tuple(metas)


def buffer_sizes(metadata: Metadata) -> dict[str, int]:
    """Elements per dtype, in order of first appearance (the order the buffers are sent in)."""
    sizes: dict[str, int] = {}
    for meta in metadata:
        key = DTYPE_NAMES[meta.dtype]
        sizes[key] = sizes.get(key, 0) + meta.numel
    return sizes


def encode_metadata(metadata: Metadata, steady: int | None = None) -> bytes:
    """Metadata as compact JSON; ``buffers`` lets the receiver check that the sizes add up.
    ``steady``: the ``verify_every`` of a steady sender (None: not one; no key is written)."""
    document: dict[str, Any] = {
        "format": METADATA_FORMAT,
        "tensors": [[m.name, DTYPE_NAMES[m.dtype], list(m.shape)] for m in metadata],
        "buffers": buffer_sizes(metadata),
    }
    if steady is not None:
        document["steady"] = {"verify_every": steady}
    return json.dumps(document, separators=(",", ":")).encode()


def decode_metadata(raw: bytes) -> Metadata:
    """Parse and validate metadata from the wire; anything malformed is a WeightTransferError."""
    return decode_document(raw)[0]


def decode_document(raw: bytes) -> tuple[Metadata, int | None]:
    """:func:`decode_metadata`, with the steady sender's ``verify_every`` (None: not steady)."""
    try:
        document = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightTransferError(f"weights metadata is not valid JSON: {err}") from None
    if not isinstance(document, dict) or document.get("format") != METADATA_FORMAT:
        raise WeightTransferError(f"weights metadata is not in the {METADATA_FORMAT} format")
    entries, sizes = document.get("tensors"), document.get("buffers")
    if not isinstance(entries, list) or not isinstance(sizes, dict):
        raise WeightTransferError("weights metadata lacks its 'tensors' list or 'buffers' map")
    metas: list[TensorMeta] = []
    seen: set[str] = set()
    for entry in entries:
        metas.append(_decode_entry(entry, seen))
    metadata = tuple(metas)
    if sizes != buffer_sizes(metadata):
        raise WeightTransferError(
            f"weights metadata buffer sizes {sizes} do not add up to its tensors' "
            f"{buffer_sizes(metadata)}"
        )
    return metadata, _decode_steady(document)


def _decode_steady(document: dict[str, Any]) -> int | None:
    if "steady" not in document:
        return None
    steady = document["steady"]
    every = steady.get("verify_every") if isinstance(steady, dict) else None
    if (not isinstance(steady, dict) or set(steady) != {"verify_every"}
            or not isinstance(every, int) or isinstance(every, bool) or every < 0):
        raise WeightTransferError(
            f"weights metadata 'steady' {steady!r} is not {{\"verify_every\": N}} with N >= 0")
    return every


def _decode_entry(entry: Any, seen: set[str]) -> TensorMeta:
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
        raise WeightTransferError(f"weights metadata entry {entry!r} is not [name, dtype, shape]")
    name, dtype, shape = entry
    if name in seen:
        raise WeightTransferError(f"weights metadata lists tensor {name!r} twice")
    seen.add(name)
    if dtype not in DTYPES:
        raise WeightTransferError(f"tensor {name!r} has unknown dtype {dtype!r}")
    # bool is an int subclass; a shape of [true] is malformed, not [1].
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise WeightTransferError(f"tensor {name!r} has invalid shape {shape!r}")
    return TensorMeta(name, DTYPES[dtype], tuple(shape))


def metadata_mismatches(metadata: Metadata, expected: Mapping[str, Tensor]) -> list[str]:
    """One line per difference between received metadata and the expected state dict."""
    received = {m.name: m for m in metadata}
    problems = [f"missing tensor {name!r}" for name in expected if name not in received]
    for meta in metadata:
        want = expected.get(meta.name)
        if want is None:
            problems.append(f"unexpected tensor {meta.name!r} ({meta.describe()})")
        elif (meta.dtype, meta.shape) != (want.dtype, tuple(want.shape)):
            wanted = TensorMeta(meta.name, want.dtype, tuple(want.shape))
            problems.append(
                f"tensor {meta.name!r} is {meta.describe()} but expected {wanted.describe()}"
            )
    return problems
