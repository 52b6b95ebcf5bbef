"""The sending end of a weight transfer: :class:`WeightSender`."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch import distributed as dist

from rlcomm.context import CommContext
from rlcomm.modes import Mode, ParallelMode

from .buffers import FlatBuffers
from .endpoint import Endpoint
from .protocol import (
    HEADER_LEN,
    NEW_METADATA,
    SENDER_ABORTED,
    SENDER_MOVED,
    SENDER_STOPPED,
    Metadata,
    WeightTransferError,
    describe_state_dict,
    encode_metadata,
)

if TYPE_CHECKING:
    from rlcomm.diagnostics.recorder import Call


class _Refused(WeightTransferError):
    """A steady sender's refusal: raised before anything is sent, so no abort header follows."""


class WeightSender(Endpoint):
    """Broadcasts a state dict to the rest of this rank's ``mode`` group (its first rank only).

    Zero-copy sends: :meth:`bind` points a module's parameters and buffers at their views in the
    send buffers, so ``send(module)`` skips their copy (any tensor not found in place is still
    copied, so binding only ever affects speed). The wire protocol is unchanged.

    ``direct`` names tensors that are not copied into the send buffers at all: each goes out
    from the caller's own tensor, in a transfer of its own after the buffers (see
    :class:`~rlcomm.weights.buffers.FlatBuffers`); its receivers must be given the same names.
    """

    _role = "sender"

    def __init__(
        self,
        ctx: CommContext,
        mode: Mode = ParallelMode.WEIGHT_TRANSFER,
        device: torch.device | str | None = None,
        verify_every: int = 0,
        first_version: int = 0,
        direct: Collection[str] = (),
        steady: bool = False,
    ) -> None:
        """``verify_every=N``: every N-th version carries each tensor's checksum, which receivers
        check after loading it into their module (0: never). ``first_version``: the version the
        receivers hold already (a sender on a new membership epoch's group goes on counting).

        ``steady``: for a static layout whose tensors are all ``direct``. Its metadata tells the
        receivers so (they need no argument), and then every version that the ``verify_every``
        schedule does not checksum and whose tensors with bytes are all direct goes out as its
        direct tensors alone: no header, one broadcast fewer (the receivers predict these
        *routine* versions; see :mod:`rlcomm.weights.protocol`, step 4). Other versions go out
        as without it. What needs a header on a version that would be routine cannot be said,
        so it raises a :class:`WeightTransferError` naming the group, before anything is sent
        (the sender and its receivers stay where they were): ``send(verify=True)`` on a version
        the schedule does not checksum, a change of names, dtypes or shapes after the first
        transfer (on any version), and :meth:`end` (always). A state dict that cannot be packed
        on a version that would be routine raises here without telling the receivers: they
        wait for that version, which the next send that succeeds delivers (else they fail at
        the group's timeout).
        """
        super().__init__(ctx, mode, device)
        if verify_every < 0:
            raise ValueError(f"verify_every: must be >= 0, got {verify_every}")
        self._version = first_version
        self._verify_every = verify_every
        self._steady = steady
        self._direct = frozenset(direct)
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self._device)
        # The send buffers of the newest metadata (bind, a change): maybe not the receivers' yet.
        self._buffers: FlatBuffers | None = None
        # The buffers of the metadata the receivers hold (``self._metadata``): the header
        # travels in them.
        self._sent: FlatBuffers | None = None
        self._pending: list[dist.Work] = []
        self._pending_calls: list[Call] = []
        self._metadata_len = 0  # the bytes of the metadata document the last change sent
        self._copied = 0  # tensors the last send copied (those not bound in place)
        # The module bind() bound, with each of its tensors and the view it must still be, when
        # every entry of its state dict was bound (then send(module) needs no state dict).
        self._bound: tuple[nn.Module, list[tuple[Tensor, Tensor]]] | None = None

    def send(self, state_dict: Mapping[str, Tensor] | nn.Module, wait: bool = True,
             verify: bool = False) -> int:
        """Send ``state_dict`` (or a module's) as the next version and return that version.

        Passing the module bound with :meth:`bind` is the fastest path: while all its tensors
        are still bound (a pointer check per tensor), no state dict is built or compared at all.

        The tensors are copied into the send buffers before this returns, so the caller may
        update them right away, except tensors of a module bound with :meth:`bind` and the
        ``direct`` ones: those are sent from where they are, not copied, and after
        ``wait=False`` they must not be updated before :meth:`wait` returns. With ``wait=False`` the broadcasts are only
        launched: call :meth:`wait` (or the next ``send``, which waits first) before relying on
        delivery. ``verify``: this version carries checksums whatever ``verify_every`` says.
        """
        self.wait()  # the buffers and header are about to be rewritten
        version = self._version + 1
        routine = self._routine(version)  # what a steady sender's receivers expect
        if verify and routine:
            self._refuse(version, f"verify=True, but verify_every={self._verify_every} does "
                                  f"not checksum it, so it goes without a header")
        try:
            buffers, changed = self._packed(state_dict, version)
            checksummed = verify or self._scheduled(version)
            if checksummed:
                buffers.write_checksums(self._checksum_helper)  # of the bytes about to go out
        except _Refused:
            raise  # nothing was sent, and nothing needs to be
        except Exception:
            if not routine:  # receivers are waiting for a header: tell them, not leave them
                self._send_header(version, SENDER_ABORTED, 0)
            raise
        self._pending, self._pending_calls = [], []
        if changed:
            self._send_metadata(version, buffers)
        self._sent = buffers  # unchanged: the receivers' metadata; changed: now it is
        wires = buffers.direct_views()
        if not routine:
            raw_len = self._metadata_len if changed else 0
            self._write_header(buffers.header, version, int(changed), raw_len, int(checksummed))
            wires.insert(0, buffers.wire)
        for tensor in wires:
            self._launch_pending(tensor)
        self._version = version
        if wait:
            self.wait()
        return version

    def _packed(self, state_dict: Mapping[str, Tensor] | nn.Module,
                version: int) -> tuple[FlatBuffers, bool]:
        """The send buffers holding ``state_dict`` (a bound module's are already in place), and
        whether its metadata changed since the last send."""
        if isinstance(state_dict, nn.Module) and self._still_bound(state_dict):
            assert self._buffers is not None
            self._copied = 0
            return self._buffers, False
        if isinstance(state_dict, nn.Module):
            state_dict = state_dict.state_dict()
        metadata = describe_state_dict(state_dict)
        changed = metadata != self._metadata
        if changed and self._steady and self._sent is not None:
            self._refuse(version, "its names, dtypes or shapes changed after the first transfer")
        buffers = self._buffers_for(metadata, changed, state_dict)
        self._copied = buffers.pack(state_dict)
        return buffers, changed

    def _scheduled(self, version: int) -> bool:
        """Whether the ``verify_every`` schedule checksums ``version``."""
        return bool(self._verify_every) and version % self._verify_every == 0

    def _routine(self, version: int) -> bool:
        """Whether a steady sender's receivers expect ``version`` without a header: they hold
        metadata whose tensors with bytes are all direct, and the schedule does not checksum it."""
        return (self._steady and self._sent is not None and self._sent.all_direct
                and not self._scheduled(version))

    def _refuse(self, version: int, why: str) -> None:
        """A steady sender's refusal of what it cannot signal (see the constructor)."""
        raise _Refused(f"{self._name}: a steady sender cannot send weights version {version}: "
                       f"{why}; nothing was sent")

    def _send_metadata(self, version: int, buffers: FlatBuffers) -> None:
        """The header of new metadata and the metadata, then the receivers' agreement."""
        raw = encode_metadata(buffers.metadata, self._verify_every if self._steady else None)
        self._metadata_len = len(raw)
        self._send_header(version, NEW_METADATA, len(raw), async_op=True)
        self._broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self._device))
        rejected = self._agree(ok=True)
        if rejected:
            raise WeightTransferError(
                f"{self._name}: receiver rank(s) {', '.join(map(str, rejected))} rejected "
                f"weights version {version} (see their errors); nothing was sent"
            )
        self._metadata = buffers.metadata  # the same object, so the next check is cheap

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
        it silently: the affected tensors are then copied again on every send, which costs time
        but never correctness (every tensor not found in place is copied; call ``bind`` again
        to restore it). After ``send(..., wait=False)``, bound tensors are the bytes being
        broadcast: call :meth:`wait` before updating them. Entries of the state dict that are
        not a parameter or buffer's own memory (state-dict hooks, a second name of a tied
        weight) stay unbound and are copied as before. The module must be on this sender's
        device (the CPU for gloo, the current GPU for NCCL).
        """
        self.wait()  # in-flight broadcasts still read the buffers about to be rewritten
        state_dict = module.state_dict()
        metadata = describe_state_dict(state_dict)
        buffers = self._buffers_for(metadata, metadata != self._metadata, state_dict)
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
            if tensor.data_ptr() != view.data_ptr():  # a direct one is its own view already
                view.copy_(tensor)
                tensor.data = view
        complete = len(targets) == len(state_dict)
        self._bound = (module, [(t, t.data) for t, _ in targets]) if complete else None

    @property
    def buffer_bytes(self) -> int:
        """The bytes of this sender's send buffers (direct tensors are the caller's: not in
        them)."""
        return self._buffers.nbytes if self._buffers is not None else 0

    def _still_bound(self, module: nn.Module) -> bool:
        """Whether ``module`` is the bound one, its every tensor still its view in the buffers
        the receivers hold: then sending it needs no state dict, metadata check or copy."""
        if self._bound is None or self._bound[0] is not module or self._buffers is None:
            return False
        if self._buffers.metadata is not self._metadata:
            return False  # the receivers do not hold this metadata yet: the full path sends it
        return all(
            t.data_ptr() == v.data_ptr() and t.shape == v.shape for t, v in self._bound[1]
        )

    def _buffers_for(self, metadata: Metadata, changed: bool,
                     state_dict: Mapping[str, Tensor]) -> FlatBuffers:
        """The send buffers for ``metadata``: the current ones when it matches, else new ones.

        New buffers replace the current ones even if the receivers then reject the metadata;
        a later send of the old metadata just allocates again (the receivers' metadata follows
        ``self._metadata``, which only changes once they all accept).
        """
        current = self._buffers
        if current is not None and (
            (not changed and current.metadata is self._metadata) or current.metadata == metadata
        ):
            return current
        # The direct views start as ``state_dict``'s own tensors: nothing allocated for them.
        self._buffers = FlatBuffers(metadata, self._device, self._direct, state_dict)
        return self._buffers

    def end(self, moved: bool) -> list[dist.Work]:
        """Tell the receivers no more versions come on this group: the run stopped, or
        (``moved``) a new membership epoch's group replaces it. Returns the works in flight,
        not waited for: a member that is gone may never complete its part (rlcomm.elastic).
        A steady sender refuses (its receivers may be expecting a version without a header)."""
        if self._steady:
            raise WeightTransferError(
                f"{self._name}: a steady sender cannot end its transfers: its receivers may be "
                f"expecting a version without a header; nothing was sent")
        works = self.abandon()
        self._send_header(self._version, SENDER_MOVED if moved else SENDER_STOPPED, 0,
                          async_op=True)
        return works + self.abandon()

    def abandon(self) -> list[dist.Work]:
        """Stop waiting for the sends in flight (a member of this group is gone); returns
        their works, which the caller keeps alive (rlcomm.elastic.Graveyard)."""
        works, self._pending = self._pending, []
        for call in self._pending_calls:
            call.finish()
        self._pending_calls = []
        return works

    def settle(self) -> list[BaseException]:
        """Like :meth:`wait`, but each send in flight is waited for on its own, and a failed
        one (its receiver is gone: at once on a closed connection, after the group's timeout
        on a downed link) does not stop the others: when this returns, no send reads the
        buffers any more. Returns the failures (an elastic group's lost members)."""
        pending, self._pending = self._pending, []
        calls, self._pending_calls = self._pending_calls, []
        failures: list[BaseException] = []
        for work in pending:
            try:
                work.wait()
            except Exception as err:
                failures.append(err)
        for call in calls:
            call.finish()
        return failures

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
        alone before the receivers hold metadata, else in a buffer of the metadata they hold.
        ``async_op`` leaves it in flight until :meth:`wait`."""
        carrier = self._sent
        header = self._header if carrier is None else carrier.header
        self._write_header(header, version, flag, length)
        wire = self._header if carrier is None else carrier.wire
        if not async_op:
            self._broadcast(wire)
            return
        self._launch_pending(wire)

    def _launch_pending(self, wire: Tensor) -> None:
        """Launch the broadcast of ``wire``, left in flight until :meth:`wait`."""
        works, call = self._launch(wire)
        self._pending += works
        self._pending_calls.append(call)

    @staticmethod
    def _write_header(
        header: Tensor, version: int, flag: int, length: int, checksummed: int = 0
    ) -> None:
        header.copy_(torch.tensor([version, flag, length, checksummed], dtype=torch.int64))
