"""What sender and receiver share: the group, its sender, the version and the collectives."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch import distributed as dist

from rlcomm.context import CommContext
from rlcomm.group_initializer import group_description
from rlcomm.modes import Mode, mode_name

from .checksums import ChecksumHelper
from .protocol import Metadata, WeightTransferError

if TYPE_CHECKING:
    from rlcomm.diagnostics.recorder import Call


_WEIGHTS_TAG = 0  # point-to-point tag of weights on an elastic group (segments: elastic.py's)


def finish(works: list[dist.Work], call: Call) -> None:
    """Wait for a launched broadcast; a timeout in wait() is diagnosed like one in a blocking
    call, then the recorded call is marked finished."""
    with call:
        for work in works:
            work.wait()
    call.finish()


class Endpoint:
    """One end of a weight transfer in this rank's ``mode`` group: its first declared rank sends
    (:class:`WeightSender`), the others receive (:class:`WeightReceiver`)."""

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
        # Sums half of a verified version's checksums where the process allows two threads.
        self._checksum_helper = ChecksumHelper()
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

    def close(self) -> None:
        """Stop this end's checksum helper thread, if one started (a later verified version
        starts it again). Dropping the last reference to this end stops it too."""
        self._checksum_helper.close()

    def _broadcast(self, tensor: Tensor) -> None:
        with self._ctx.recorder.call(self._mode, "broadcast", tensor, self._src):
            if self._ctx.epochs.holds(self._mode):
                for work in self._point_to_point(tensor):
                    work.wait()
            else:
                dist.broadcast(tensor, src=self._src, group=self._group)

    def _launch(self, wire: Tensor) -> tuple[list[dist.Work], Call]:
        """Launch the broadcast of ``wire`` (header and data); the caller waits on the works and
        then marks the recorded call finished."""
        with self._ctx.recorder.call(self._mode, "broadcast", wire, self._src) as call:
            if self._ctx.epochs.holds(self._mode):
                works = self._point_to_point(wire)
            else:
                work = dist.broadcast(wire, src=self._src, group=self._group, async_op=True)
                works = [work] if work is not None else []
            call.pending(works)
        return works, call

    def _point_to_point(self, tensor: Tensor) -> list[dist.Work]:
        """A broadcast on an elastic group (rlcomm.elastic): the sender (group rank 0) sends to
        each member on its own, so a lost member fails only its own transfer."""
        if self._rank != self._src:
            return [self._group.recv([tensor], 0, _WEIGHTS_TAG)]
        works = []
        for peer in range(1, self._ctx.get_world_size(self._mode)):
            try:
                works.append(self._group.send([tensor], peer, _WEIGHTS_TAG))
            except RuntimeError:  # its connection closed: the member is gone, the others go on
                continue
        return works

    def _agree(self, ok: bool) -> list[int]:
        """All members report whether they accept the metadata; returns the rejecting ranks."""
        flags = torch.zeros(len(self._declared), dtype=torch.int64, device=self._device)
        flags[self._ctx.get_local_rank(self._mode)] = 0 if ok else 1
        with self._ctx.recorder.call(self._mode, "all_reduce", flags):
            if self._ctx.epochs.holds(self._mode):  # possibly not in torch's world maps
                self._group.allreduce([flags]).wait()
            else:
                dist.all_reduce(flags, group=self._group)
        ranks = self._ctx.get_ranks_in_group(self._mode)  # the group-rank order of ``flags``
        return [ranks[i] for i, flag in enumerate(flags.tolist()) if flag]
