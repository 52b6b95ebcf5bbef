"""The receiving end of a weight transfer: :class:`WeightReceiver` and its receive buffers."""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch import distributed as dist

from rlcomm.context import CommContext
from rlcomm.modes import Mode, ParallelMode

from .buffers import FlatBuffers
from .checksums import tensor_checksum
from .endpoint import Endpoint, finish
from .protocol import (
    HEADER_LEN,
    NEW_METADATA,
    SAME_METADATA,
    SENDER_ABORTED,
    SENDER_MOVED,
    SENDER_STOPPED,
    Metadata,
    TransfersEnded,
    WeightTransferError,
    decode_document,
    metadata_mismatches,
)

if TYPE_CHECKING:
    from rlcomm.diagnostics.recorder import Call


@dataclass(eq=False)
class ReceiveBuffer:
    """One receive buffer of the receiver's metadata and what belongs to it."""

    flat: FlatBuffers  # its wire bytes, metadata and views
    version: int = 0  # the version it last completed (0: none yet)
    checksummed: bool = False  # whether that version came with checksums
    # The bound module's tensors with their views here (looked up once, so pointing the module
    # at this buffer is one pointer assignment per tensor); None until it first is.
    pairs: list[tuple[Tensor, Tensor]] | None = None
    in_module: bool = False  # the bound module's tensors are these views
    posted: tuple[list[dist.Work], Call] | None = None  # a posted receive in flight into it
    # The posted receives of its direct tensors (issued with ``posted``, completed after it).
    direct_posted: list[tuple[list[dist.Work], Call]] = field(default_factory=list)
    # The version a posted receive of a steady sender's routine version brings (its direct
    # tensors only: ``posted`` stays None); 0: none.
    routine: int = 0

    @property
    def busy(self) -> bool:
        """Whether a posted receive is in flight into it."""
        return self.posted is not None or bool(self.routine)

    @property
    def metadata(self) -> Metadata:
        return self.flat.metadata


class ReceiveBuffers:
    """A receiver's buffers of the current metadata, in the order they were allocated, and the
    module bound to them (:meth:`WeightReceiver.bind`): which one the module points at, which
    one is spare, and pointing the module at one. ``name``: the receiver's, for errors."""

    def __init__(self, name: str, device: torch.device, direct: frozenset[str]) -> None:
        self.name, self.device, self.direct = name, device, direct
        self.all: list[ReceiveBuffer] = []
        self.newest: ReceiveBuffer | None = None  # its header slot carries the next header
        self.landing: dict[str, Tensor] = {}  # the bound module's direct tensors, when bound
        self.bound: nn.Module | None = None

    def bind(self, module: nn.Module) -> None:
        """``module``'s tensors are pointed at the buffers from now on."""
        self.bound = module
        named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        self.landing = {name: named[name].detach() for name in self.direct if name in named}
        for buffer in self.all:
            buffer.pairs = None  # of the module bound before

    def renew(self, metadata: Metadata) -> None:
        """The buffers of new ``metadata``: the old metadata's go (the bound module keeps the
        ones it points at until its next load); the data that follows lands in the first."""
        self.newest = ReceiveBuffer(FlatBuffers(metadata, self.device, self.direct, self.landing))
        self.all = [self.newest]

    @property
    def nbytes(self) -> int:
        return sum(buffer.flat.nbytes for buffer in self.all)

    def landing_buffer(self) -> ReceiveBuffer | None:
        """The buffer whose direct views are the bound module's own memory, if any."""
        return next((buffer for buffer in self.all if buffer.flat.landed), None)

    def in_module(self) -> ReceiveBuffer | None:
        """The buffer of the current metadata the bound module points at, if any."""
        return next((buffer for buffer in self.all if buffer.in_module), None)

    def spare(self) -> ReceiveBuffer:
        """A buffer of the current metadata that holds nothing in use (allocated when none is
        free): neither the newest version, nor the bound module's, nor a posted receive's."""
        assert self.newest is not None
        for buffer in self.all:
            if (buffer is not self.newest and not buffer.in_module and not buffer.busy
                    and not buffer.flat.landed):  # landing: the caller's memory, in place only
                return buffer
        spare = ReceiveBuffer(FlatBuffers(self.newest.metadata, self.device, self.direct))
        self.all.append(spare)
        return spare

    @torch.no_grad()
    def point(self, module: nn.Module, buffer: ReceiveBuffer) -> None:
        """Point the bound module's tensors at ``buffer``'s views (a swap of pointers). The
        module's tensors are looked up once per buffer: replacing a parameter object (not its
        ``.data``) after the first load needs :meth:`bind` again."""
        if buffer.pairs is None:
            buffer.pairs = self.pair_up(module, buffer.flat)
        for tensor, view in buffer.pairs:
            if tensor.data_ptr() != view.data_ptr():
                tensor.data = view
        for each in self.all:
            each.in_module = each is buffer

    def pair_up(self, module: nn.Module, flat: FlatBuffers) -> list[tuple[Tensor, Tensor]]:
        """The bound module's tensor for each tensor of the metadata, in its order, with its
        view in ``flat``; checks names, shapes and dtypes."""
        named = {
            **dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False)),
        }
        pairs: list[tuple[Tensor, Tensor]] = []
        for meta in flat.metadata:
            tensor, view = named.get(meta.name), flat.views[meta.name]
            if tensor is None:
                raise WeightTransferError(
                    f"{self.name}: the bound module has no parameter or buffer {meta.name!r}"
                )
            if tensor.shape != view.shape or tensor.dtype != view.dtype:
                raise WeightTransferError(
                    f"{self.name}: cannot load {meta.name!r}: the module holds "
                    f"{list(tensor.shape)} {tensor.dtype}, the weights have "
                    f"{list(view.shape)} {view.dtype}"
                )
            pairs.append((tensor, view))
        return pairs

    def verify(self, module: nn.Module, buffer: ReceiveBuffer, rank: int,
               helper: Any) -> None:
        """Each loaded tensor's checksum against the sender's; names the first that differs."""
        flat = buffer.flat
        pairs = buffer.pairs if module is self.bound else None
        if pairs is not None:
            # The module's tensors are these buffers' views (``_point`` just made sure), so
            # their checksums are the views', summed in one batch; names only on a mismatch.
            if bool(torch.equal(flat.view_checksums(helper), flat.checksums)):
                return
            state = {m.name: t for m, (t, _) in zip(flat.metadata, pairs)}
        else:
            state = module.state_dict()
        theirs = flat.checksums.tolist()
        for meta, want in zip(flat.metadata, theirs):
            if meta.name not in state:  # not loaded (strict=False): nothing to compare
                continue
            got = tensor_checksum(state[meta.name])
            if got != want:
                raise WeightTransferError(
                    f"{self.name}: weights version {buffer.version} loaded on rank {rank} "
                    f"differ from the sender's: first differing tensor {meta.name!r} "
                    f"(checksum {got:#x}, sender's {want:#x})"
                )


class WeightReceiver(Endpoint):
    """Receives the state dicts the first rank of this rank's ``mode`` group sends.

    With ``expected``, metadata that differs from it (names, shapes, dtypes) is rejected before
    any data moves, and the sender fails too.

    Zero-copy receives: :meth:`bind` lets loads point a module's tensors at the receive buffer of
    the version being loaded, so nothing is copied. :meth:`post` receives the next version into a
    spare buffer in the background (double buffering): the module keeps acting with the version
    it holds until :meth:`load` swaps the new one in.

    ``direct`` names the tensors that travel on their own after the buffers (the sender's
    ``direct``): those of the module bound with :meth:`bind` are received straight into that
    module's tensors as they were when bound (the *landing* buffer, used only by receives in
    place: it is the memory the caller acts with), the others into buffers of their own.

    A steady sender (``WeightSender(steady=True)``; its metadata says so) sends its routine
    versions without a header: this receiver predicts them and numbers them itself
    (:mod:`rlcomm.weights.protocol`, step 4).
    """

    _role = "receiver"

    def __init__(
        self,
        ctx: CommContext,
        mode: Mode = ParallelMode.WEIGHT_TRANSFER,
        expected: Mapping[str, Tensor] | None = None,
        device: torch.device | str | None = None,
        direct: Collection[str] = (),
    ) -> None:
        super().__init__(ctx, mode, device)
        self._expected = expected
        self._direct = frozenset(direct)
        # Posted direct receives whose data never came (the sender ended instead): kept alive
        # until abandon() hands them to the caller.
        self._orphans: list[dist.Work] = []
        # Every receive buffer of the current metadata; a spare is one that is neither the
        # newest, nor the bound module's, nor a posted receive's.
        self._buffers = ReceiveBuffers(self._name, self._device, self._direct)
        self._posted: deque[ReceiveBuffer] = deque()  # in the order they were posted
        # The accepted metadata's steady sender's ``verify_every`` (None: not a steady one).
        self._steady: int | None = None

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
        carrier = self._buffers.newest  # the buffers this receiver holds carry the header
        if carrier is not None:
            in_module = self._buffers.in_module()
            if in_place:
                carrier = self._buffers.landing_buffer() or in_module or carrier
            elif carrier is in_module or carrier.flat.landed:
                # The bound module acts with these: receive beside them.
                carrier = self._buffers.spare()
            if self._routine(self._version + 1):  # no header comes: only the direct tensors
                self._receive_direct(carrier.flat)
                return self._completed(carrier, self._version + 1, checksummed=0)
        if carrier is None:
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._device)
            self._broadcast(header)
        else:
            self._receive_wire(carrier.flat.wire)
            header = carrier.flat.header
        version, flag, length, checksummed = self._check_header(header)
        if flag == NEW_METADATA:
            self._accept_metadata(version, length)
            newest = self._buffers.newest
            assert newest is not None
            self._receive_wire(newest.flat.wire)
            checksummed = int(newest.flat.header[3])
            self._receive_direct(newest.flat)
        elif carrier is None:  # flag 0 for a receiver without metadata: the data came with it
            raise WeightTransferError(
                f"{self._name}: version {version} came without metadata; create the "
                f"WeightReceiver before the sender's first send and keep using it"
            )
        else:
            newest = self._buffers.newest = carrier
            self._receive_direct(newest.flat)
        self._version = newest.version = version
        newest.checksummed = bool(checksummed)
        return version, dict(newest.flat.views)

    def post(self, in_place: bool = False) -> None:
        """Start receiving the next version into a spare buffer, in the background;
        ``in_place``: into the buffer the bound module acts with (the landing buffer, where
        there is one), which must then be idle until the receive is completed.

        The transfer completes while the caller goes on (acting with the weights it holds);
        :meth:`load` or :meth:`receive` completes it. Posted receives are issued on the group
        like any collective, so the sender's sends and every other operation on the group must
        be issued in the same order on all members. Needs the metadata of a completed receive and a
        sender whose metadata does not change while receives are posted.
        """
        if self._buffers.newest is None:
            raise WeightTransferError(
                f"{self._name}: post() needs the metadata of a completed receive first"
            )
        carrier = (self._buffers.landing_buffer() or self._buffers.in_module()) if in_place else None
        if carrier is None or carrier.busy:
            carrier = self._buffers.spare()
        version = self._version + len(self._posted) + 1
        if self._routine(version):  # no header comes: only the direct tensors
            carrier.routine = version
        else:
            carrier.posted = self._launch(carrier.flat.wire)
        carrier.direct_posted = [self._launch(t) for t in carrier.flat.direct_views()]
        self._posted.append(carrier)

    def abandon(self) -> list[dist.Work]:
        """Give up the posted receives (their sender moved on: rlcomm.elastic); returns their
        works, which the caller keeps alive, with the buffers they write into."""
        works, self._orphans = self._orphans, []
        while self._posted:
            buffer = self._posted.popleft()
            if buffer.posted is not None:
                (posted, call), buffer.posted = buffer.posted, None
                call.finish()
                works += posted
            buffer.routine = 0
            works += self._orphan(buffer)
        return works

    def _orphan(self, buffer: ReceiveBuffer) -> list[dist.Work]:
        """``buffer``'s posted direct receives, given up (no data follows its header)."""
        direct, buffer.direct_posted = buffer.direct_posted, []
        for _, call in direct:
            call.finish()
        return [work for works, _ in direct for work in works]

    @property
    def posted(self) -> int:
        """How many posted receives have not been completed yet."""
        return len(self._posted)

    @property
    def buffer_bytes(self) -> int:
        """The bytes of the receive buffers this receiver holds (direct tensors landing in the
        bound module's memory are the caller's: not in them)."""
        return self._buffers.nbytes

    def ready(self) -> bool:
        """Whether the oldest posted receive has arrived (completing it will not block)."""
        if not self._posted:
            return False
        oldest = self._posted[0]
        header = [oldest.posted] if oldest.posted is not None else []
        return oldest.busy and all(
            w.is_completed() for works, _ in [*header, *oldest.direct_posted] for w in works)

    def load(self, module: nn.Module, strict: bool = True) -> int:
        """Load the newest completed version into ``module`` and verify it if it carries
        checksums; returns its version. Completes every posted receive that has already arrived
        first, without waiting for the others. A module bound with :meth:`bind` is pointed at the
        version's buffer (no copy); any other module is copied into (``load_state_dict``)."""
        while self.ready():
            self._complete_posted()
        newest = self._buffers.newest
        if newest is None:
            raise WeightTransferError(f"{self._name}: nothing received yet to load")
        if module is self._buffers.bound:
            self._buffers.point(module, newest)
        else:
            module.load_state_dict(newest.flat.views, strict=strict)
        if newest.checksummed:
            self._buffers.verify(module, newest, self._rank, self._checksum_helper)
        return self._version

    def receive_into(self, module: nn.Module, strict: bool = True) -> int:
        """Receive the next version and load it into ``module`` (see :meth:`load`).

        The module bound with :meth:`bind` receives in place: the bytes land in the buffer it
        already points at, so there is no second buffer to fill and nothing to swap, but the
        module must not be used until this returns (use :meth:`post` to act meanwhile).
        """
        self._receive(in_place=module is self._buffers.bound)
        return self.load(module, strict=strict)

    def bind(self, module: nn.Module) -> None:
        """Let :meth:`load` point ``module``'s parameters and buffers at the received bytes
        instead of copying them (zero-copy receives). Without an ``expected`` state dict, the
        module's becomes it, so a sender's name, shape or dtype change is rejected
        before data moves. The module's tensors change only inside :meth:`load` (and
        :meth:`receive_into`, which receives in place)."""
        if self._expected is None:
            self._expected = {k: v.detach() for k, v in module.state_dict().items()}
        self._buffers.bind(module)

    def _receive_wire(self, wire: Tensor) -> None:
        works, call = self._launch(wire)
        finish(works, call)

    def _receive_direct(self, flat: FlatBuffers) -> None:
        """The direct tensors of the version whose buffers ``flat`` just received, side by side."""
        for works, call in [self._launch(tensor) for tensor in flat.direct_views()]:
            finish(works, call)

    def _complete_posted(self) -> tuple[int, dict[str, Tensor]]:
        buffer = self._posted.popleft()
        if buffer.routine:  # a steady sender's routine version: its direct tensors only
            version, buffer.routine, checksummed = buffer.routine, 0, 0
            self._finish_direct(buffer)
            return self._completed(buffer, version, checksummed)
        assert buffer.posted is not None
        (works, call), buffer.posted = buffer.posted, None
        try:
            finish(works, call)
            version, flag, _, checksummed = self._check_header(buffer.flat.header)
        except Exception:  # no data follows (or the group failed): keep the direct works
            self._orphans += self._orphan(buffer)
            raise
        if flag == SAME_METADATA:
            self._finish_direct(buffer)
        else:
            self._orphans += self._orphan(buffer)
            raise WeightTransferError(
                f"{self._name}: weights version {version} changes its metadata while receives "
                f"are posted; post() needs a sender whose names, dtypes and shapes stay fixed"
            )
        return self._completed(buffer, version, checksummed)

    def _finish_direct(self, buffer: ReceiveBuffer) -> None:
        for works, call in buffer.direct_posted:
            finish(works, call)
        buffer.direct_posted = []

    def _completed(self, buffer: ReceiveBuffer, version: int,
                   checksummed: int) -> tuple[int, dict[str, Tensor]]:
        """``buffer`` holds ``version`` now: the newest."""
        self._buffers.newest = buffer
        self._version = buffer.version = version
        buffer.checksummed = bool(checksummed)
        return version, dict(buffer.flat.views)

    def _routine(self, version: int) -> bool:
        """Whether ``version`` comes from a steady sender without a header (protocol.py, step 4):
        its tensors with bytes are all direct and its schedule does not checksum it."""
        every = self._steady
        newest = self._buffers.newest
        return (every is not None and newest is not None and newest.flat.all_direct
                and not (every and version % every == 0))

    def _check_header(self, header: Tensor) -> tuple[int, int, int, int]:
        version, flag, length, checksummed = header.tolist()
        if flag in (SENDER_STOPPED, SENDER_MOVED):
            moved = flag == SENDER_MOVED
            raise TransfersEnded(
                f"{self._name}: sender rank {self._src} "
                f"{'moved to a new membership epoch' if moved else 'stopped'} after version "
                f"{self._version}", moved=moved)
        if flag == SENDER_ABORTED:
            raise WeightTransferError(
                f"{self._name}: sender rank {self._src} aborted weights version {version} "
                f"(its state dict could not be packed; see its error)"
            )
        if (flag not in (SAME_METADATA, NEW_METADATA) or length < 0 or version <= self._version
                or (self._steady is not None and version != self._version + 1)):
            raise WeightTransferError(
                f"{self._name}: malformed header {header.tolist()} after version {self._version}"
            )
        return version, flag, length, checksummed

    def _accept_metadata(self, version: int, length: int) -> None:
        raw = torch.empty(length, dtype=torch.uint8, device=self._device)
        self._broadcast(raw)
        metadata: Metadata | None = None
        steady: int | None = None
        problem = ""
        try:
            metadata, steady = decode_document(raw.cpu().numpy().tobytes())
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
        self._steady = steady
        if metadata != self._metadata:
            self._metadata = metadata
            self._buffers.renew(metadata)
