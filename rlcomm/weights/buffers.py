"""The flat buffers of one metadata (names, dtypes, shapes): the wire bytes of
:mod:`rlcomm.weights.protocol` and every tensor's view into them."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import Tensor

from .checksums import (
    PARALLEL_CHECKSUM_BYTES,
    ChecksumHelper,
    batched_checksums,
    checksum_parts,
    halves,
)
from .protocol import ALIGN, DTYPES, HEADER_LEN, HEADER_SLOT, Metadata, buffer_sizes


class FlatBuffers:
    """One persistent flat buffer per dtype (segments of one allocation), and every tensor's view.

    Allocated once per metadata; packing and broadcasting reuse the same memory every transfer.

    ``direct`` names the tensors that are not in the wire: each travels on its own, after it,
    straight from the sender's own tensor into the receiver's (no pack, no copy out), so a large
    tensor that cannot be bound (a sharded trainer's local shard, whose storage FSDP owns) or
    must land in a caller's memory (a slice of a rollout rank's whole weights) is not copied.
    Their views are the tensors of ``landing`` that fit (contiguous, same shape, dtype and
    device), else allocated here; :meth:`place` points one at another tensor.
    """

    def __init__(self, metadata: Metadata, device: torch.device,
                 direct: Collection[str] = (), landing: Mapping[str, Tensor] | None = None) -> None:
        self.metadata = metadata
        # Empty tensors have no bytes to send on their own.
        self.direct = [m.name for m in metadata if m.name in direct and m.numel]
        outside = set(self.direct)
        # Every tensor with bytes is direct: the buffers carry no data, only a header and
        # checksums (a steady sender's routine versions skip them: protocol.py, step 4).
        self.all_direct = all(m.name in outside or not m.numel for m in metadata)
        # Every dtype's buffer is an aligned segment of one uint8 allocation, which goes out as
        # a single broadcast (one collective round however many dtypes the model mixes).
        segments: list[tuple[torch.dtype, int, int]] = []
        end = HEADER_SLOT
        inside = tuple(m for m in metadata if m.name not in outside)
        for key, numel in buffer_sizes(inside).items():
            dtype = DTYPES[key]
            segments.append((dtype, end, numel * dtype.itemsize))
            end += -(-numel * dtype.itemsize // ALIGN) * ALIGN
        checksums_at = end
        end += -(-len(metadata) * 8 // ALIGN) * ALIGN
        wire = torch.empty(end, dtype=torch.uint8, device=device)
        self.header = wire[: 8 * HEADER_LEN].view(torch.int64)
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
        self.landed = False  # some direct view is a tensor of ``landing`` (the caller's memory)
        self._allocated: set[str] = set()  # the direct views allocated here
        for meta in metadata:
            if meta.name in outside:
                found = _fitting((landing or {}).get(meta.name), meta.shape, meta.dtype, device)
                self.landed |= found is not None
                if found is None:
                    found = torch.empty(meta.shape, dtype=meta.dtype, device=device)
                    self._allocated.add(meta.name)
                self.views[meta.name] = found
                continue
            start = offsets[meta.dtype]
            view = self.buffers[meta.dtype][start : start + meta.numel].view(meta.shape)
            offsets[meta.dtype] = start + meta.numel
            self.views[meta.name] = view
            names, views = self._groups[meta.dtype]
            names.append(meta.name)
            views.append(view)
        # Bytes on the wire: backends need not know every dtype, and bits survive untouched.
        self.wire = wire
        self._checksum_parts = [checksum_parts(self.views[m.name]) for m in metadata]
        self._index = {m.name: i for i, m in enumerate(metadata)}
        self._checksum_halves = halves([self.views[m.name].nbytes for m in metadata])

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
        for name in self.direct:  # sent from the caller's own tensor: not copied
            tensor = state_dict[name].detach()
            if not _is_view_of(tensor, self.views[name]):
                self.place(name, tensor.contiguous())  # a copy only if it is not contiguous
        return copied

    def place(self, name: str, tensor: Tensor) -> None:
        """Point the direct view ``name`` at ``tensor`` (contiguous, of its shape and dtype)."""
        self.views[name] = tensor
        self._checksum_parts[self._index[name]] = checksum_parts(tensor)
        self._allocated.discard(name)

    @property
    def nbytes(self) -> int:
        """The bytes these buffers allocated: the wire and the direct views not the caller's."""
        return self.wire.nbytes + sum(self.views[name].nbytes for name in self._allocated)

    def direct_views(self) -> list[Tensor]:
        """The direct tensors, in the order they travel (the metadata's)."""
        return [self.views[name] for name in self.direct]

    def view_checksums(self, helper: ChecksumHelper | None = None) -> Tensor:
        """Every view's :func:`tensor_checksum`, in metadata order, as one int64 tensor.

        The word and tail views are sliced once per set of buffers, so this is one reduction per
        tensor and no per-tensor Python beyond it: verifying a version costs about one read of
        its bytes, not one call of :func:`tensor_checksum` per tensor. Large CPU buffers are
        summed by two threads, each over half the bytes, where the process allows two (see
        :class:`ChecksumHelper`; ``helper`` is the caller's, else one lives for this call).
        """
        two_threads = self.wire.is_cpu and self.wire.nbytes >= PARALLEL_CHECKSUM_BYTES
        return batched_checksums(self._checksum_parts, self._checksum_halves, two_threads, helper)

    def write_checksums(self, helper: ChecksumHelper | None = None) -> None:
        """Every tensor's checksum of the bytes in the buffers (the sender's, before sending)."""
        self.checksums.copy_(self.view_checksums(helper))


def _fitting(tensor: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> Tensor | None:
    """``tensor`` (detached) if a direct tensor of ``shape`` and ``dtype`` can travel in its
    bytes on ``device``, else None."""
    if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
        return None
    if tensor.device != device or not tensor.is_contiguous():
        return None
    return tensor.detach()


def _is_view_of(tensor: Tensor, view: Tensor) -> bool:
    """Whether ``tensor`` is exactly ``view``'s memory (same start, strides and device), so that
    copying it into ``view`` would change nothing. Dtype and shape match already (same metadata).
    """
    return (
        tensor.data_ptr() == view.data_ptr()
        and tensor.stride() == view.stride()
        and tensor.device == view.device
    )
