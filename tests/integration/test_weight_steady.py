"""A steady rlcomm.weights sender between real gloo processes (``WeightSender(steady=True)``):
its routine versions (not checksummed by its schedule, every tensor with bytes direct) go out as
their direct tensors alone, one broadcast each and no header, and arrive exact on receivers that
predict them, received in place or posted two ahead; its checksummed versions carry the header
and are verified (a corrupted byte in a direct tensor is caught naming it); a plain sender still
sends the header every version; and what a steady sender cannot signal without a header is
refused before anything is sent (a failed routine version too), so the next send delivers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from rlcomm import CommContext
from rlcomm.modes import mode_name
from rlcomm.testing import run_ranks
from rlcomm.weights import WeightReceiver, WeightSender, WeightTransferError
from tests.helpers.weights import TIMEOUT_S, WT, weight_groups

pytestmark = pytest.mark.integration

DIRECT = {"big", "bf"}  # "empty" is not direct, but has no bytes: the buffers carry no data
VERSIONS = 7
EVERY = 3  # versions 3 and 6 are checksummed


def _state(version: int, rows: int = 300) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {"big": torch.randn(rows, 40, generator=gen),
            "bf": torch.randn(513, generator=gen).to(torch.bfloat16),
            "empty": torch.zeros(0)}


class Held(nn.Module):
    """A receiving module holding the state's names as buffers."""

    def __init__(self) -> None:
        super().__init__()
        for name, tensor in _state(0).items():
            self.register_buffer(name, torch.zeros_like(tensor))


def _same(state: dict[str, torch.Tensor], version: int) -> bool:
    want = _state(version)
    return set(state) == set(want) and all(
        torch.equal(t.view(torch.uint8), want[n].view(torch.uint8)) if t.numel()
        else t.shape == want[n].shape for n, t in state.items())


def _broadcasts(ctx: CommContext) -> int:
    """The collectives this rank entered on the weight-transfer group so far."""
    return int(ctx.recorder.table().get(mode_name(WT), {}).get("entered", 0))


class CorruptingReceiver(WeightReceiver):
    """A real receiver whose direct "big" tensor gets one bit flipped on arrival of version 3."""

    def _receive(self, in_place: bool) -> tuple[int, dict[str, torch.Tensor]]:
        version, state = super()._receive(in_place)
        if version == EVERY:
            state["big"].reshape(-1).view(torch.uint8)[9] ^= 0x04
        return version, state


def _send(ctx: CommContext, steady: bool, direct: set[str]) -> dict[str, Any]:
    sender = WeightSender(ctx, verify_every=EVERY, direct=direct, steady=steady)
    counts = []
    for version in range(1, VERSIONS + 1):
        before = _broadcasts(ctx)
        sender.send(_state(version))
        counts.append(_broadcasts(ctx) - before)
    return {"counts": counts, "total": _broadcasts(ctx)}


def _in_place(receiver: WeightReceiver, module: Held) -> dict[str, Any]:
    exact, errors = [], []
    for version in range(1, VERSIONS + 1):
        try:
            got = receiver.receive_into(module)
        except WeightTransferError as err:
            errors.append(str(err))
            continue
        exact.append(got == version and _same(dict(module.state_dict()), version))
    return {"exact": exact, "errors": errors}


def _posted_ahead(receiver: WeightReceiver, module: Held) -> dict[str, Any]:
    """Version 1 in place (it brings the metadata), then two receives posted ahead at a time."""
    receiver.receive_into(module)
    received, loaded = [1], [_same(dict(module.state_dict()), 1)]
    while receiver.version < VERSIONS:
        while receiver.posted < 2 and receiver.version + receiver.posted < VERSIONS:
            receiver.post()
        version, views = receiver.receive()  # completes the oldest posted receive
        received.append(version if _same(views, version) else -version)
        got = receiver.load(module)  # may complete the next one too, if it has arrived
        loaded.append(_same(dict(module.state_dict()), got))
    return {"received": received, "loaded": loaded, "last": receiver.version}


def _ranks(rank: int, world_size: int, steady: bool, corrupt: bool,
           direct: set[str] = DIRECT) -> Any:
    with weight_groups([[0, 1, 2]]) as ctx:
        if rank == 0:
            return _send(ctx, steady, direct)
        module = Held()
        kind = CorruptingReceiver if corrupt and rank == 1 else WeightReceiver
        receiver = kind(ctx, expected=module.state_dict(), direct=direct)
        receiver.bind(module)
        found = _in_place(receiver, module) if rank == 1 else _posted_ahead(receiver, module)
        return {**found, "total": _broadcasts(ctx)}


def _check_arrivals(found: dict[int, Any]) -> None:
    assert found[1]["exact"] == [True] * VERSIONS and not found[1]["errors"], found[1]
    received = found[2]["received"]
    assert received == sorted(set(received)) and all(v > 0 for v in received), found[2]
    assert all(found[2]["loaded"]) and found[2]["last"] == VERSIONS, found[2]


def test_routine_versions_go_without_a_header_and_arrive_exact() -> None:
    found = run_ranks(_ranks, 3, True, False, timeout=TIMEOUT_S)
    counts = found[0]["counts"]
    # Version 1: its header, the metadata, the agreement, the buffers, then the 2 direct ones.
    assert counts[0] == 6, counts
    # Routine: one broadcast per direct tensor; checksummed (3, 6): the header and buffers too.
    assert counts[1:] == [2, 3, 2, 2, 3, 2], counts
    # Each receiver, in place or posted ahead, took part in exactly the sender's broadcasts.
    assert found[1]["total"] == found[2]["total"] == found[0]["total"], found
    _check_arrivals(found)


def test_a_plain_sender_still_sends_the_header_every_version() -> None:
    found = run_ranks(_ranks, 3, False, False, timeout=TIMEOUT_S)
    assert found[0]["counts"] == [6] + [3] * (VERSIONS - 1), found[0]
    assert found[1]["total"] == found[2]["total"] == found[0]["total"], found
    _check_arrivals(found)


def test_a_steady_sender_with_a_packed_tensor_sends_the_header_every_version() -> None:
    found = run_ranks(_ranks, 3, True, False, {"big"}, timeout=TIMEOUT_S)  # "bf" is packed
    # Version 1: its header, the metadata, the agreement, the buffers, then "big"; after it,
    # the buffers (header and "bf" together) and "big", checksummed or not.
    assert found[0]["counts"] == [5] + [2] * (VERSIONS - 1), found[0]
    assert found[1]["total"] == found[2]["total"] == found[0]["total"], found
    _check_arrivals(found)


def test_a_byte_corrupted_in_a_direct_tensor_of_a_checksummed_version_is_caught() -> None:
    found = run_ranks(_ranks, 3, True, True, timeout=TIMEOUT_S)
    errors = found[1]["errors"]
    assert len(errors) == 1 and f"weights version {EVERY}" in errors[0], errors
    assert "'big'" in errors[0], errors
    assert found[1]["exact"] == [True] * (VERSIONS - 1), found[1]  # every other version


def _refusing(rank: int, world_size: int) -> Any:
    """Version 1, then the three refusals and a state dict that cannot be packed (nothing sent:
    the receivers wait for version 2), then versions 2 and 3 (3 with ``verify=True``, which its
    schedule checksums anyway)."""
    with weight_groups([[0, 1, 2]]) as ctx:
        if rank != 0:
            module = Held()
            receiver = WeightReceiver(ctx, expected=module.state_dict(), direct=DIRECT)
            receiver.bind(module)
            return [receiver.receive_into(module) == v and _same(dict(module.state_dict()), v)
                    for v in (1, 2, 3)]
        sender = WeightSender(ctx, verify_every=EVERY, direct=DIRECT, steady=True)
        sender.send(_state(1))
        refusals = []
        for attempt in (lambda: sender.send(_state(2), verify=True),
                        lambda: sender.send(_state(2, rows=299)),
                        lambda: sender.end(moved=False),
                        lambda: sender.send({**_state(2), "bf": "not a tensor"})):
            try:
                attempt()
                refusals.append("")
            except WeightTransferError as err:
                refusals.append(str(err))
        before = _broadcasts(ctx)
        versions = [sender.send(_state(2)), sender.send(_state(3), verify=True)]
        return {"refusals": refusals, "versions": versions, "after": _broadcasts(ctx) - before}


def test_what_a_steady_sender_cannot_signal_is_refused_before_anything_is_sent() -> None:
    found = run_ranks(_refusing, 3, timeout=TIMEOUT_S)
    verify, change, end, unpacked = found[0]["refusals"]
    group = "WEIGHT_TRANSFER"
    assert group in verify and "verify=True" in verify and "version 2" in verify, verify
    assert group in change and "names, dtypes or shapes changed" in change, change
    assert group in end and "cannot end" in end, end
    assert all("steady sender" in text for text in (verify, change, end))
    # A state dict that cannot be packed on a routine version fails on the sender alone.
    assert "'bf' is of type str" in unpacked, unpacked
    # The sender stayed at version 1 and the receivers saw nothing of the refusals.
    assert found[0]["versions"] == [2, 3] and found[0]["after"] == 2 + 3, found[0]
    assert found[1] == found[2] == [True, True, True], found
