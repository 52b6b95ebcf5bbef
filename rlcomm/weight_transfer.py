"""Trainer -> rollout weight transfer over a WEIGHT_TRANSFER group.

The group's first declared rank (the trainer) runs a :class:`WeightSender`, every other member a
:class:`WeightReceiver`. Tensors are grouped by dtype into one persistent flat buffer per dtype,
all of them segments of one allocation whose bytes go out as a single ``broadcast``, so every
dtype crosses any backend bit-exactly and the buffers are allocated once, not once per transfer.

Wire protocol, per transfer (plain tensors only; nothing is pickled). The data goes out as one
uint8 buffer: a 64-byte slot for the header, then every dtype's values in a segment of its own,
in the order the metadata lists the dtypes, each starting at a multiple of 64 bytes.

1. an int64 header ``[version, metadata_flag, metadata_len, checksummed]``. Before any metadata was accepted
   it is broadcast alone; after that it travels in the header slot of the buffer of the layout
   the receivers hold, so a transfer whose metadata is unchanged is a single broadcast (the
   header and the data together) and nothing follows;
2. when the flag is ``1`` (the names, dtypes or shapes changed, always on the first transfer):
   the metadata as UTF-8 JSON in a uint8 tensor, then an all_reduce of one reject flag per group
   member, so a rejected transfer fails on every member instead of leaving anyone waiting, then
   the data in a buffer of the new layout.

When the header rides in a buffer whose flag is not ``0``, that buffer's data is not a version:
receivers ignore it (their views of the last version are overwritten, as by any receive).

A flag of ``-1`` means the sender could not pack its state dict: receivers raise, nothing follows.

Verification: after the dtype segments every buffer has a segment of one int64 per tensor. When a
sender verifies a version (``verify_every``), it writes each tensor's checksum of its exact bytes
there and sets ``checksummed``; a receiver that loads that version into a module recomputes the
checksums from the module's tensors and raises, naming the first tensor that differs.

Zero-copy sends: :meth:`WeightSender.bind` points a module's parameters and buffers at their views
in the send buffers, so ``send(module.state_dict())`` skips their copy (any tensor not found in
place is still copied, so binding only ever affects speed). The wire protocol is unchanged.
Zero-copy receives: :meth:`WeightReceiver.bind` lets loads point a module's tensors at the receive
buffer of the version being loaded, so nothing is copied. :meth:`WeightReceiver.post` receives the
next version into a spare buffer in the background (double buffering): the module keeps acting
with the version it holds until :meth:`WeightReceiver.load` swaps the new one in.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch import distributed as dist

from .context import CommContext
from .errors import RlcommError
from .group_initializer import group_description
from .modes import Mode, ParallelMode, mode_name

if TYPE_CHECKING:
    from rlcomm.diagnostics.recorder import Call

__all__ = ["TensorMeta", "WeightReceiver", "WeightSender", "WeightTransferError", "tensor_checksum"]

METADATA_FORMAT = "rlcomm.weights/1"

# Header flags (the header's second entry).
_SAME_METADATA = 0
_NEW_METADATA = 1
_SENDER_ABORTED = -1

# Names accepted on the wire; anything else in received metadata is rejected.
_DTYPES: dict[str, torch.dtype] = {
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
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


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
        return f"{list(self.shape)} {_DTYPE_NAMES.get(self.dtype, str(self.dtype))}"


Metadata = tuple[TensorMeta, ...]


def describe_state_dict(state_dict: Mapping[str, Tensor]) -> Metadata:
    """The metadata of ``state_dict`` in its order; non-tensors and unknown dtypes are errors."""
    metas = []
    for name, tensor in state_dict.items():
        if not isinstance(tensor, Tensor):
            raise WeightTransferError(
                f"state dict entry {name!r} is of type {type(tensor).__name__}, not a tensor"
            )
        if tensor.dtype not in _DTYPE_NAMES:
            raise WeightTransferError(
                f"state dict entry {name!r} has unsupported dtype {tensor.dtype}; "
                f"supported: {', '.join(_DTYPES)}"
            )
        metas.append(TensorMeta(str(name), tensor.dtype, tuple(tensor.shape)))
    return tuple(metas)


def _buffer_sizes(metadata: Metadata) -> dict[str, int]:
    """Elements per dtype, in order of first appearance (the order the buffers are sent in)."""
    sizes: dict[str, int] = {}
    for meta in metadata:
        key = _DTYPE_NAMES[meta.dtype]
        sizes[key] = sizes.get(key, 0) + meta.numel
    return sizes


def encode_metadata(metadata: Metadata) -> bytes:
    """Metadata as compact JSON; ``buffers`` lets the receiver check that the sizes add up."""
    document = {
        "format": METADATA_FORMAT,
        "tensors": [[m.name, _DTYPE_NAMES[m.dtype], list(m.shape)] for m in metadata],
        "buffers": _buffer_sizes(metadata),
    }
    return json.dumps(document, separators=(",", ":")).encode()


def decode_metadata(raw: bytes) -> Metadata:
    """Parse and validate metadata from the wire; anything malformed is a WeightTransferError."""
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
    if sizes != _buffer_sizes(metadata):
        raise WeightTransferError(
            f"weights metadata buffer sizes {sizes} do not add up to its tensors' "
            f"{_buffer_sizes(metadata)}"
        )
    return metadata


def _decode_entry(entry: Any, seen: set[str]) -> TensorMeta:
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
        raise WeightTransferError(f"weights metadata entry {entry!r} is not [name, dtype, shape]")
    name, dtype, shape = entry
    if name in seen:
        raise WeightTransferError(f"weights metadata lists tensor {name!r} twice")
    seen.add(name)
    if dtype not in _DTYPES:
        raise WeightTransferError(f"tensor {name!r} has unknown dtype {dtype!r}")
    # bool is an int subclass; a shape of [true] is malformed, not [1].
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise WeightTransferError(f"tensor {name!r} has invalid shape {shape!r}")
    return TensorMeta(name, _DTYPES[dtype], tuple(shape))


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


_ALIGN = 64  # bytes; every dtype's segment of the wire starts at a multiple of this
_HEADER_SLOT = _ALIGN  # bytes before the first segment: the header (4 int64) and padding
_HEADER_LEN = 4  # [version, metadata_flag, metadata_len, checksummed]


def tensor_checksum(tensor: Tensor) -> int:
    """A checksum of ``tensor``'s bytes: their sum as little 64-bit words (wrapping), cheap
    enough to run on every transfer (about memory bandwidth). Any single changed byte changes it.
    """
    raw = tensor.detach().reshape(-1).view(torch.uint8)
    body = raw.numel() // 8 * 8
    try:
        words = raw[:body].view(torch.int64)
    except RuntimeError:  # not 8-byte aligned in its storage: sum an aligned copy instead
        words = raw[:body].clone().view(torch.int64)
    total = int(words.sum()) + int(raw[body:].sum()) if raw.numel() else 0
    return (total + 2**63) % 2**64 - 2**63  # as a signed int64, as it travels


class _FlatBuffers:
    """One persistent flat buffer per dtype (segments of one allocation), and every tensor's view.

    Allocated once per metadata; packing and broadcasting reuse the same memory every transfer.
    """

    def __init__(self, metadata: Metadata, device: torch.device) -> None:
        self.metadata = metadata
        # Every dtype's buffer is an aligned segment of one uint8 allocation, which goes out as
        # a single broadcast (one collective round however many dtypes the model mixes).
        segments: list[tuple[torch.dtype, int, int]] = []
        end = _HEADER_SLOT
        for key, numel in _buffer_sizes(metadata).items():
            dtype = _DTYPES[key]
            segments.append((dtype, end, numel * dtype.itemsize))
            end += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
        checksums_at = end
        end += -(-len(metadata) * 8 // _ALIGN) * _ALIGN
        wire = torch.empty(end, dtype=torch.uint8, device=device)
        self.header = wire[: 8 * _HEADER_LEN].view(torch.int64)
        # One checksum per tensor, in metadata order; valid when the header says so.
        self.checksums = wire[checksums_at : checksums_at + 8 * len(metadata)].view(torch.int64)
        self.buffers = {
            dtype: wire[start : start + nbytes].view(dtype) for dtype, start, nbytes in segments
        }
        self.views: dict[str, Tensor] = {}
        self._groups: dict[torch.dtype, tuple[list[str], list[Tensor]]] = {
            dtype: ([], []) for dtype in self.buffers
        }
        offsets = dict.fromkeys(self.buffers, 0)
        for meta in metadata:
            start = offsets[meta.dtype]
            view = self.buffers[meta.dtype][start : start + meta.numel].view(meta.shape)
            offsets[meta.dtype] = start + meta.numel
            self.views[meta.name] = view
            names, views = self._groups[meta.dtype]
            names.append(meta.name)
            views.append(view)
        # Bytes on the wire: backends need not know every dtype, and bits survive untouched.
        self.wire = wire
        self._checksum_parts = [_checksum_parts(self.views[m.name]) for m in metadata]
        self._checksum_halves = _halves([self.views[m.name].nbytes for m in metadata])

    @torch.no_grad()  # the buffers must not join the autograd graph of the parameters
    def pack(self, state_dict: Mapping[str, Tensor]) -> int:
        """Copy every tensor of ``state_dict`` that is not already its own view into the buffers
        (one bound by :meth:`WeightSender.bind`); returns how many tensors were copied."""
        copied = 0
        for names, views in self._groups.values():
            targets: list[Tensor] = []
            sources: list[Tensor] = []
            for name, view in zip(names, views):
                tensor = state_dict[name]
                if view.numel() and not _is_view_of(tensor, view):  # empty: nothing to copy
                    targets.append(view)
                    sources.append(tensor)
            if targets:
                torch._foreach_copy_(targets, sources)
                copied += len(targets)
        return copied

    def view_checksums(self) -> Tensor:
        """Every view's :func:`tensor_checksum`, in metadata order, as one int64 tensor.

        The word and tail views are sliced once per layout, so this is one reduction per
        tensor and no per-tensor Python beyond it: verifying a version costs about one read of
        its bytes, not one call of :func:`tensor_checksum` per tensor. Large CPU buffers are
        summed by two threads, each over half the bytes: one core sums at a fraction of the
        memory's bandwidth, and during a verification the peer's core is idle (it waits for
        these checksums, or for this rank to receive the next version).
        """
        parts = self._checksum_parts
        if not parts:
            return torch.zeros(0, dtype=torch.int64)
        sums: list[Tensor] = [torch.zeros((), dtype=torch.int64)] * len(parts)

        def run(indices: list[int]) -> None:
            for i in indices:
                sums[i] = _checksum_of(parts[i])

        helper = _checksum_helper() if self.wire.nbytes >= _PARALLEL_CHECKSUM_BYTES else None
        if helper is None or not self.wire.is_cpu:
            run(list(range(len(parts))))
        else:
            mine, theirs = self._checksum_halves
            done = helper.submit(run, theirs)
            run(mine)
            done.result()
        return torch.stack(sums)

    def write_checksums(self) -> None:
        """Every tensor's checksum of the bytes in the buffers (the sender's, before sending)."""
        self.checksums.copy_(self.view_checksums())


# A view's bytes split for summing: its whole 64-bit words and the bytes after them, or the view
# itself when its words are not 8-byte aligned in memory (then summed as an aligned copy).
_ChecksumParts = tuple[Tensor, Tensor] | Tensor


def _checksum_parts(view: Tensor) -> _ChecksumParts:
    raw = view.reshape(-1).view(torch.uint8)
    body = raw.numel() // 8 * 8
    try:
        return raw[:body].view(torch.int64), raw[body:]
    except RuntimeError:  # not 8-byte aligned in its storage
        return view


_PARALLEL_CHECKSUM_BYTES = 1 << 20  # below this, handing half to a thread costs more than it saves
_helper: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool): a forked child needs its own


def _checksum_helper() -> ThreadPoolExecutor | None:
    """This process's one checksum helper thread, or None where only one core is usable."""
    global _helper
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (usable or 1) < 2:
        return None
    if _helper is None or _helper[0] != os.getpid():
        _helper = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="rlcomm-checksum"))
    return _helper[1]


def _halves(sizes: list[int]) -> tuple[list[int], list[int]]:
    """Indices of ``sizes`` in two groups of about equal sums (largest first, to the lighter)."""
    groups: tuple[list[int], list[int]] = ([], [])
    totals = [0, 0]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lighter = 0 if totals[0] <= totals[1] else 1
        groups[lighter].append(i)
        totals[lighter] += sizes[i]
    return groups


def _checksum_of(parts: _ChecksumParts) -> Tensor:
    if isinstance(parts, Tensor):
        return torch.tensor(tensor_checksum(parts), dtype=torch.int64)
    words, tail = parts
    # int64 sums wrap like the checksum's 64-bit words; an empty sum is 0.
    return words.sum() + tail.sum() if tail.numel() else words.sum()


def _finish(works: list[dist.Work], call: Call) -> None:
    """Wait for a launched broadcast; a timeout in wait() is diagnosed like one in a blocking
    call, then the recorded call is marked finished."""
    with call:
        for work in works:
            work.wait()
    call.finish()


def _is_view_of(tensor: Tensor, view: Tensor) -> bool:
    """Whether ``tensor`` is exactly ``view``'s memory (same start, strides and device), so that
    copying it into ``view`` would change nothing. Dtype and shape match already (same metadata).
    """
    return (
        tensor.data_ptr() == view.data_ptr()
        and tensor.stride() == view.stride()
        and tensor.device == view.device
    )


class _Endpoint:
    """What sender and receiver share: the group, its sender, the version and the buffers."""

    _role = ""

    def __init__(self, ctx: CommContext, mode: Mode, device: torch.device | str | None) -> None:
        self._ctx = ctx
        self._mode = mode_name(mode)
        self._group = ctx.get_group(mode)
        self._declared = ctx.get_declared_ranks(mode)
        self._src = self._declared[0]
        self._rank = ctx.get_global_rank()
        self._device = torch.device(device) if device is not None else ctx.get_device(mode)
        self._version = 0
        self._metadata: Metadata | None = None
        self._buffers: _FlatBuffers | None = None
        is_sender = self._rank == self._src
        if is_sender != (self._role == "sender"):
            raise WeightTransferError(
                f"rank {self._rank} cannot be a Weight{self._role.capitalize()} in {self._name}: "
                f"rank {self._src} (its first declared rank) sends, the others receive"
            )

    @property
    def _name(self) -> str:
        return group_description(self._mode, self._declared)

    @property
    def version(self) -> int:
        """The last weights version sent/received; 0 before the first transfer."""
        return self._version

    def _broadcast(self, tensor: Tensor) -> None:
        with self._ctx.recorder.call(self._mode, "broadcast", tensor, self._src):
            dist.broadcast(tensor, src=self._src, group=self._group)

    def _launch(self, wire: Tensor) -> tuple[list[dist.Work], Call]:
        """Launch the broadcast of ``wire`` (header and data); the caller waits on the works and
        then marks the recorded call finished."""
        with self._ctx.recorder.call(self._mode, "broadcast", wire, self._src) as call:
            work = dist.broadcast(wire, src=self._src, group=self._group, async_op=True)
            works = [work] if work is not None else []
            call.pending(works)
        return works, call

    def _receive_wire(self, buffers: _FlatBuffers) -> None:
        works, call = self._launch(buffers.wire)
        _finish(works, call)

    def _agree(self, ok: bool) -> list[int]:
        """All members report whether they accept the metadata; returns the rejecting ranks."""
        flags = torch.zeros(len(self._declared), dtype=torch.int64, device=self._device)
        flags[self._ctx.get_local_rank(self._mode)] = 0 if ok else 1
        with self._ctx.recorder.call(self._mode, "all_reduce", flags):
            dist.all_reduce(flags, group=self._group)
        ranks = self._ctx.get_ranks_in_group(self._mode)  # the group-rank order of ``flags``
        return [ranks[i] for i, flag in enumerate(flags.tolist()) if flag]


class WeightSender(_Endpoint):
    """Broadcasts a state dict to the rest of this rank's ``mode`` group (its first rank only)."""

    _role = "sender"

    def __init__(
        self,
        ctx: CommContext,
        mode: Mode = ParallelMode.WEIGHT_TRANSFER,
        device: torch.device | str | None = None,
        verify_every: int = 0,
    ) -> None:
        """``verify_every=N``: every N-th version carries each tensor's checksum, which receivers
        check after loading it into their module (0: never)."""
        super().__init__(ctx, mode, device)
        if verify_every < 0:
            raise ValueError(f"verify_every: must be >= 0, got {verify_every}")
        self._verify_every = verify_every
        self._header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self._device)
        # The buffers of the layout the receivers hold (metadata ``self._metadata``): the header
        # travels in them. ``self._buffers`` may already be a new layout (bind, a change).
        self._sent: _FlatBuffers | None = None
        self._pending: list[dist.Work] = []
        self._pending_calls: list[Call] = []
        self._copied = 0  # tensors the last send copied (those not bound in place)
        # The module bind() bound, with each of its tensors and the view it must still be, when
        # every entry of its state dict was bound (then send(module) needs no state dict).
        self._bound: tuple[nn.Module, list[tuple[Tensor, Tensor]]] | None = None

    def send(self, state_dict: Mapping[str, Tensor] | nn.Module, wait: bool = True) -> int:
        """Send ``state_dict`` (or a module's) as the next version and return that version.

        Passing the module bound with :meth:`bind` is the fastest path: while all its tensors
        are still bound (a pointer check per tensor), no state dict is built or compared at all.

        The tensors are copied into the send buffers before this returns, so the caller may
        update them right away, except tensors of a module bound with :meth:`bind`: those are
        already in the buffers, so they are not copied, and after ``wait=False`` they must not
        be updated before :meth:`wait` returns. With ``wait=False`` the broadcasts are only
        launched: call :meth:`wait` (or the next ``send``, which waits first) before relying on
        delivery.
        """
        self.wait()  # the buffers and header are about to be rewritten
        version = self._version + 1
        try:
            if isinstance(state_dict, nn.Module) and self._still_bound(state_dict):
                assert self._buffers is not None
                changed, buffers, self._copied = False, self._buffers, 0
            else:
                if isinstance(state_dict, nn.Module):
                    state_dict = state_dict.state_dict()
                metadata = describe_state_dict(state_dict)
                changed = metadata != self._metadata
                buffers = self._layout(metadata, changed)
                self._copied = buffers.pack(state_dict)
            checksummed = bool(self._verify_every) and version % self._verify_every == 0
            if checksummed:
                buffers.write_checksums()  # of the exact bytes about to go out
        except Exception:
            # Receivers are waiting for a header; tell them instead of leaving them hanging.
            self._send_header(version, _SENDER_ABORTED, 0)
            raise
        raw = encode_metadata(buffers.metadata) if changed else b""
        self._pending, self._pending_calls = [], []
        if changed:
            self._send_header(version, _NEW_METADATA, len(raw), async_op=True)
            self._broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self._device))
            rejected = self._agree(ok=True)
            if rejected:
                raise WeightTransferError(
                    f"{self._name}: receiver rank(s) {', '.join(map(str, rejected))} rejected "
                    f"weights version {version} (see their errors); nothing was sent"
                )
            self._metadata = buffers.metadata  # the same object, so the next check is cheap
        self._sent = buffers  # unchanged: the receivers' layout; changed: now it is
        self._write_header(buffers.header, version, int(changed), len(raw), int(checksummed))
        works, call = self._launch(buffers.wire)
        self._pending += works
        self._pending_calls.append(call)
        self._version = version
        if wait:
            self.wait()
        return version

    @torch.no_grad()
    def bind(self, module: nn.Module) -> None:
        """Make ``module``'s parameters and buffers live in the send buffers (zero-copy sends).

        Allocates the send buffers for ``module.state_dict()`` (or reuses the current ones when
        its names, dtypes and shapes are unchanged), copies every parameter's and buffer's
        current value into its view there once, and points its ``.data`` at that view. A later
        ``send(module.state_dict())`` then finds those tensors already in place and skips their
        copy: only the broadcasts remain. Nothing is sent here, and receivers are unaffected.

        In-place updates (optimizer steps, ``p.add_(...)`` under ``no_grad``,
        ``load_state_dict`` without ``assign=True``) keep the binding. Code that replaces
        ``.data``, re-creates parameters or moves the module (``.to(...)``, ``.half()``) breaks
        it silently: the
        affected tensors are then copied again on every send, which costs time but never
        correctness (every tensor not found in place is copied; call ``bind`` again to restore
        it). After ``send(..., wait=False)``, bound tensors are the bytes being broadcast: call
        :meth:`wait` before updating them. Entries of the state dict that are not a parameter
        or buffer's own memory (state-dict hooks, a second name of a tied weight) stay unbound
        and are copied as before. The module must be on this sender's device (the CPU for
        gloo, the current GPU for NCCL).
        """
        self.wait()  # in-flight broadcasts still read the buffers about to be rewritten
        state_dict = module.state_dict()
        metadata = describe_state_dict(state_dict)
        buffers = self._layout(metadata, metadata != self._metadata)
        targets: list[tuple[Tensor, Tensor]] = []
        seen: set[int] = set()
        named = [
            *module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False),
        ]
        for name, tensor in named:
            view = buffers.views.get(name)
            entry = state_dict.get(name)
            if view is None or entry is None or id(tensor) in seen:
                continue
            if entry.data_ptr() != tensor.data_ptr() or entry.shape != tensor.shape:
                continue  # the state dict holds something derived from it: leave it to pack
            if tensor.device != view.device:
                raise WeightTransferError(
                    f"{self._name}: cannot bind {name!r} on {tensor.device}: the send buffers "
                    f"are on {view.device}"
                )
            seen.add(id(tensor))
            targets.append((tensor, view))
        for tensor, view in targets:
            view.copy_(tensor)
            tensor.data = view
        complete = len(targets) == len(state_dict)
        self._bound = (module, [(t, t.data) for t, _ in targets]) if complete else None

    def _still_bound(self, module: nn.Module) -> bool:
        """Whether ``module`` is the bound one, its every tensor still its view in the buffers
        the receivers hold: then sending it needs no state dict, metadata check or copy."""
        if self._bound is None or self._bound[0] is not module or self._buffers is None:
            return False
        if self._buffers.metadata is not self._metadata:
            return False  # the receivers do not hold this layout yet: the full path sends it
        return all(
            t.data_ptr() == v.data_ptr() and t.shape == v.shape for t, v in self._bound[1]
        )

    def _layout(self, metadata: Metadata, changed: bool) -> _FlatBuffers:
        """The send buffers for ``metadata``: the current ones when it matches, else new ones.

        New buffers replace the current ones even if the receivers then reject the metadata;
        a later send of the old metadata just allocates again (the receivers' layout follows
        ``self._metadata``, which only changes once they all accept).
        """
        current = self._buffers
        if current is not None and (
            (not changed and current.metadata is self._metadata) or current.metadata == metadata
        ):
            return current
        self._buffers = _FlatBuffers(metadata, self._device)
        return self._buffers

    def wait(self) -> None:
        """Block until the last ``send(..., wait=False)`` has been delivered."""
        pending, self._pending = self._pending, []
        calls, self._pending_calls = self._pending_calls, []
        if not calls:
            return
        with calls[-1]:  # a timeout in wait() is diagnosed like one in a blocking call
            for work in pending:
                work.wait()
        for call in calls:
            call.finish()

    def _send_header(self, version: int, flag: int, length: int, async_op: bool = False) -> None:
        """A header whose data does not follow in the same broadcast (flag ``1`` or ``-1``):
        alone before the receivers hold a layout, else in a buffer of the layout they hold.
        ``async_op`` leaves it in flight until :meth:`wait`."""
        carrier = self._sent
        header = self._header if carrier is None else carrier.header
        self._write_header(header, version, flag, length)
        wire = self._header if carrier is None else carrier.wire
        if not async_op:
            self._broadcast(wire)
            return
        works, call = self._launch(wire)
        self._pending += works
        self._pending_calls.append(call)

    @staticmethod
    def _write_header(
        header: Tensor, version: int, flag: int, length: int, checksummed: int = 0
    ) -> None:
        header.copy_(torch.tensor([version, flag, length, checksummed], dtype=torch.int64))


class WeightReceiver(_Endpoint):
    """Receives the state dicts the first rank of this rank's ``mode`` group sends.

    With ``expected``, metadata that differs from it (names, shapes, dtypes) is rejected before
    any data moves, and the sender fails too.
    """

    _role = "receiver"

    def __init__(
        self,
        ctx: CommContext,
        mode: Mode = ParallelMode.WEIGHT_TRANSFER,
        expected: Mapping[str, Tensor] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(ctx, mode, device)
        self._expected = expected
        self._checksummed = False  # whether the newest version came with checksums
        self._bound: nn.Module | None = None
        self._spares: list[_FlatBuffers] = []  # buffers of the current layout not in use
        self._posted: deque[tuple[_FlatBuffers, list[dist.Work], Call]] = deque()
        self._in_module: _FlatBuffers | None = None  # the buffers the bound module points at
        # Per receive buffer (by id): the bound module's tensors and their views there, so a
        # swap is one pointer assignment per tensor, without walking the module again.
        self._pairs: dict[int, list[tuple[Tensor, Tensor]]] = {}

    def receive(self) -> tuple[int, dict[str, Tensor]]:
        """Wait for the next transfer; returns its version and the state dict.

        The tensors are views into persistent receive buffers: a later ``receive`` may overwrite
        them in place. Clone them (or use :meth:`receive_into`) to keep a version. A receive
        started with :meth:`post` is completed first (transfers arrive in order).
        """
        return self._receive(in_place=False)

    def _receive(self, in_place: bool) -> tuple[int, dict[str, Tensor]]:
        """:meth:`receive`; ``in_place``: into the buffer the bound module points at (it must
        be idle until the receive is done), else beside it."""
        if self._posted:
            return self._complete_posted()
        carrier = self._buffers  # the layout this receiver holds carries the header
        in_module = self._in_module
        if carrier is not None and in_module is not None:
            if in_place and in_module.metadata is carrier.metadata:
                carrier = in_module
            elif carrier is in_module:
                carrier = self._spare()  # the bound module acts with these: receive beside them
        if carrier is None:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self._device)
            self._broadcast(header)
        else:
            self._receive_wire(carrier)
            header = carrier.header
        version, flag, length, checksummed = self._check_header(header)
        if flag == _NEW_METADATA:
            self._accept_metadata(version, length)
            assert self._buffers is not None
            self._receive_wire(self._buffers)
            checksummed = int(self._buffers.header[3])
        elif carrier is None:  # flag 0 for a receiver without a layout: the data came with it
            raise WeightTransferError(
                f"{self._name}: version {version} came without metadata; create the "
                f"WeightReceiver before the sender's first send and keep using it"
            )
        else:
            self._make_newest(carrier)
        assert self._buffers is not None
        self._version, self._checksummed = version, bool(checksummed)
        return version, dict(self._buffers.views)

    def post(self) -> None:
        """Start receiving the next version into a spare buffer, in the background.

        The transfer completes while the caller goes on (acting with the weights it holds);
        :meth:`load` or :meth:`receive` completes it. Posted receives are issued on the group
        like any collective, so the sender's sends and every other operation on the group must
        be issued in the same order on all members. Needs a layout (a completed receive) and a
        sender whose metadata does not change while receives are posted.
        """
        if self._buffers is None:
            raise WeightTransferError(
                f"{self._name}: post() needs the layout of a completed receive first"
            )
        spare = self._spare()
        works, call = self._launch(spare.wire)
        self._posted.append((spare, works, call))

    @property
    def posted(self) -> int:
        """How many posted receives have not been completed yet."""
        return len(self._posted)

    def ready(self) -> bool:
        """Whether the oldest posted receive has arrived (completing it will not block)."""
        return bool(self._posted) and all(w.is_completed() for w in self._posted[0][1])

    def load(self, module: nn.Module, strict: bool = True) -> int:
        """Load the newest completed version into ``module`` and verify it if it carries
        checksums; returns its version. Completes every posted receive that has already arrived
        first, without waiting for the others. A module bound with :meth:`bind` is pointed at the
        version's buffer (no copy); any other module is copied into (``load_state_dict``)."""
        while self.ready():
            self._complete_posted()
        if self._buffers is None:
            raise WeightTransferError(f"{self._name}: nothing received yet to load")
        buffers = self._buffers
        if module is self._bound:
            self._point(module, buffers)
        else:
            module.load_state_dict(buffers.views, strict=strict)
        if self._checksummed:
            self._verify(module, buffers)
        return self._version

    def receive_into(self, module: nn.Module, strict: bool = True) -> int:
        """Receive the next version and load it into ``module`` (see :meth:`load`).

        The module bound with :meth:`bind` receives in place: the bytes land in the buffer it
        already points at, so there is no second buffer to fill and nothing to swap, but the
        module must not be used until this returns (use :meth:`post` to act meanwhile).
        """
        self._receive(in_place=module is self._bound)
        return self.load(module, strict=strict)

    def bind(self, module: nn.Module) -> None:
        """Let :meth:`load` point ``module``'s parameters and buffers at the received bytes
        instead of copying them (zero-copy receives). Without an ``expected`` layout, the
        module's state dict becomes it, so a sender's name, shape or dtype change is rejected
        before data moves. The module's tensors change only inside :meth:`load` (and
        :meth:`receive_into`, which receives in place)."""
        if self._expected is None:
            self._expected = {k: v.detach() for k, v in module.state_dict().items()}
        self._bound = module
        self._pairs = {}

    def _complete_posted(self) -> tuple[int, dict[str, Tensor]]:
        buffers, works, call = self._posted.popleft()
        _finish(works, call)
        version, flag, _, checksummed = self._check_header(buffers.header)
        if flag != _SAME_METADATA:
            raise WeightTransferError(
                f"{self._name}: weights version {version} changes the layout while receives "
                f"are posted; post() needs a sender whose names, dtypes and shapes stay fixed"
            )
        self._make_newest(buffers)
        self._version, self._checksummed = version, bool(checksummed)
        return version, dict(buffers.views)

    def _check_header(self, header: Tensor) -> tuple[int, int, int, int]:
        version, flag, length, checksummed = header.tolist()
        if flag == _SENDER_ABORTED:
            raise WeightTransferError(
                f"{self._name}: sender rank {self._src} aborted weights version {version} "
                f"(its state dict could not be packed; see its error)"
            )
        if flag not in (_SAME_METADATA, _NEW_METADATA) or length < 0 or version <= self._version:
            raise WeightTransferError(
                f"{self._name}: malformed header {header.tolist()} after version {self._version}"
            )
        return version, flag, length, checksummed

    def _spare(self) -> _FlatBuffers:
        """A buffer of the current layout that holds nothing in use (allocated when none is
        free): neither the newest version, nor the bound module's, nor a posted receive's."""
        assert self._buffers is not None
        busy = {id(self._buffers), id(self._in_module), *(id(b) for b, _, _ in self._posted)}
        for spare in self._spares:
            if id(spare) not in busy and spare.metadata is self._buffers.metadata:
                return spare
        spare = _FlatBuffers(self._buffers.metadata, self._device)
        self._spares.append(spare)
        return spare

    def _make_newest(self, buffers: _FlatBuffers) -> None:
        if self._buffers is not None and self._buffers not in self._spares:
            self._spares.append(self._buffers)
        self._buffers = buffers

    @torch.no_grad()
    def _point(self, module: nn.Module, buffers: _FlatBuffers) -> None:
        """Point the bound module's tensors at ``buffers``' views (a swap of pointers). The
        module's tensors are looked up once per buffer: replacing a parameter object (not its
        ``.data``) after the first load needs :meth:`bind` again."""
        pairs = self._pairs.get(id(buffers))
        if pairs is None:
            pairs = self._pairs[id(buffers)] = self._pair_up(module, buffers)
        for tensor, view in pairs:
            if tensor.data_ptr() != view.data_ptr():
                tensor.data = view
        self._in_module = buffers

    def _pair_up(self, module: nn.Module, buffers: _FlatBuffers) -> list[tuple[Tensor, Tensor]]:
        """The bound module's tensor for each tensor of the metadata, in its order, with its
        view in ``buffers``; checks the layout."""
        named = {
            **dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False)),
        }
        pairs: list[tuple[Tensor, Tensor]] = []
        for meta in buffers.metadata:
            tensor, view = named.get(meta.name), buffers.views[meta.name]
            if tensor is None:
                raise WeightTransferError(
                    f"{self._name}: the bound module has no parameter or buffer {meta.name!r}"
                )
            if tensor.shape != view.shape or tensor.dtype != view.dtype:
                raise WeightTransferError(
                    f"{self._name}: cannot load {meta.name!r}: the module holds "
                    f"{list(tensor.shape)} {tensor.dtype}, weights version {self._version} has "
                    f"{list(view.shape)} {view.dtype}"
                )
            pairs.append((tensor, view))
        return pairs

    def _verify(self, module: nn.Module, buffers: _FlatBuffers) -> None:
        """Each loaded tensor's checksum against the sender's; names the first that differs."""
        pairs = self._pairs.get(id(buffers)) if module is self._bound else None
        if pairs is not None:
            # The module's tensors are these buffers' views (``_point`` just made sure), so
            # their checksums are the views', summed in one batch; names only on a mismatch.
            if bool(torch.equal(buffers.view_checksums(), buffers.checksums)):
                return
            state = {m.name: t for m, (t, _) in zip(buffers.metadata, pairs)}
        else:
            state = module.state_dict()
        theirs = buffers.checksums.tolist()
        for meta, want in zip(buffers.metadata, theirs):
            if meta.name not in state:  # not loaded (strict=False): nothing to compare
                continue
            got = tensor_checksum(state[meta.name])
            if got != want:
                raise WeightTransferError(
                    f"{self._name}: weights version {self._version} loaded on rank {self._rank} "
                    f"differ from the sender's: first differing tensor {meta.name!r} "
                    f"(checksum {got:#x}, sender's {want:#x})"
                )

    def _accept_metadata(self, version: int, length: int) -> None:
        raw = torch.empty(length, dtype=torch.uint8, device=self._device)
        self._broadcast(raw)
        metadata: Metadata | None = None
        problem = ""
        try:
            metadata = decode_metadata(raw.cpu().numpy().tobytes())
            if self._expected is not None:
                problem = "; ".join(metadata_mismatches(metadata, self._expected))
        except WeightTransferError as err:
            problem = str(err)
        rejected = self._agree(ok=not problem)  # every member joins, rejecting or not
        if problem or metadata is None:
            raise WeightTransferError(
                f"{self._name}: rank {self._rank} rejected weights version {version} "
                f"from rank {self._src}: {problem}"
            )
        if rejected:
            raise WeightTransferError(
                f"{self._name}: weights version {version} was not sent because receiver "
                f"rank(s) {', '.join(map(str, rejected))} rejected it"
            )
        if metadata != self._metadata:
            self._metadata, self._buffers = metadata, _FlatBuffers(metadata, self._device)
            self._spares, self._pairs = [], {}  # of the old layout
