"""rlcomm.weights' direct tensors between real gloo processes: named tensors skip the buffers,
going straight from the sender's tensor (never copied into a send buffer) into a bound
receiving module's own tensors in lockstep (never in a receive buffer; the module keeps its
memory), or into buffers of their own beside the module when posted; every version exact,
verified, and a byte corrupted in a direct tensor caught naming it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from rlcomm.testing import run_ranks
from rlcomm.weights import WeightReceiver, WeightSender, WeightTransferError
from tests.helpers.weights import TIMEOUT_S, weight_groups

pytestmark = pytest.mark.integration

DIRECT = {"big", "bf", "empty"}  # "empty" has no bytes: it travels nowhere
VERSIONS = 3


def _state(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {"small": torch.randn(7, generator=gen),
            "big": torch.randn(300, 40, generator=gen),
            "bf": torch.randn(513, generator=gen).to(torch.bfloat16),
            "empty": torch.zeros(0),
            "steps": torch.tensor([version], dtype=torch.int64)}


class Held(nn.Module):
    """A receiving module holding the state's names as buffers."""

    def __init__(self) -> None:
        super().__init__()
        for name, tensor in _state(0).items():
            self.register_buffer(name, torch.zeros_like(tensor))


def _exact(module: nn.Module, version: int) -> bool:
    want = _state(version)
    return all(torch.equal(t.view(torch.uint8) if t.numel() else t,
                           want[n].view(torch.uint8) if t.numel() else want[n])
               for n, t in module.state_dict().items())


class CorruptingReceiver(WeightReceiver):
    """A real receiver whose direct "big" tensor gets one bit flipped on arrival of version 2."""

    def _receive(self, in_place: bool) -> tuple[int, dict[str, torch.Tensor]]:
        version, state = super()._receive(in_place)
        if version == 2:
            state["big"].reshape(-1).view(torch.uint8)[9] ^= 0x04
        return version, state


def _ranks(rank: int, world_size: int, corrupt: bool) -> Any:
    with weight_groups([[0, 1, 2]]) as ctx:
        if rank == 0:
            sender = WeightSender(ctx, verify_every=1, direct=DIRECT)
            pointers = []
            for version in range(1, VERSIONS + 1):
                state = _state(version)
                sender.send(state, wait=False)
                sender.wait()
                pointers.append(state["big"].data_ptr())
            return {"buffer": sender.buffer_bytes}
        module = Held()
        def direct_memory() -> dict[str, int]:
            return {n: t.data_ptr() for n, t in module.state_dict().items()
                    if n in DIRECT and t.numel()}

        acting = direct_memory()
        kind = CorruptingReceiver if corrupt and rank == 1 else WeightReceiver
        receiver = kind(ctx, expected=module.state_dict(), direct=DIRECT)
        receiver.bind(module)
        exact, kept, errors = [], [], []
        for version in range(1, VERSIONS + 1):
            try:
                if rank == 1 or version == 1:  # lockstep: in place
                    receiver.receive_into(module)
                else:  # beside: the module acts with the last version until the load
                    receiver.post()
                    receiver.receive()
                    kept.append(_exact(module, version - 1))
                    receiver.load(module)
            except WeightTransferError as err:
                errors.append(str(err))
                continue
            exact.append(_exact(module, version))
        same = acting == direct_memory()
        return {"exact": exact, "kept": kept, "same": same, "errors": errors,
                "buffer": receiver.buffer_bytes}


def test_direct_tensors_skip_the_buffers_and_arrive_exact_and_verified() -> None:
    found = run_ranks(_ranks, 3, False, timeout=TIMEOUT_S)
    direct_bytes = sum(t.nbytes for n, t in _state(0).items() if n in DIRECT)
    packed_bytes = sum(t.nbytes for n, t in _state(0).items() if n not in DIRECT)
    # The sender's buffer holds the header, the packed tensors and the checksums only.
    assert found[0]["buffer"] < direct_bytes, found[0]
    assert found[0]["buffer"] <= packed_bytes + 512, found[0]
    for rank in (1, 2):
        assert found[rank]["exact"] == [True] * VERSIONS, found[rank]
        assert not found[rank]["errors"], found[rank]
    # In lockstep the direct tensors arrive in the module's own memory: no buffer holds them.
    assert found[1]["same"] and found[1]["buffer"] <= packed_bytes + 512, found[1]
    # Posted beside the module: it keeps the version it acts with until the load, and the
    # direct tensors come in buffers of their own.
    assert found[2]["kept"] == [True] * (VERSIONS - 1), found[2]
    assert not found[2]["same"] and found[2]["buffer"] > direct_bytes, found[2]


def test_a_byte_corrupted_in_a_direct_tensor_is_caught_naming_it() -> None:
    found = run_ranks(_ranks, 3, True, timeout=TIMEOUT_S)
    errors = found[1]["errors"]
    assert len(errors) == 1 and "weights version 2" in errors[0] and "'big'" in errors[0], errors
    assert found[1]["exact"] == [True, True], found[1]  # versions 1 and 3
    assert found[2]["exact"] == [True] * VERSIONS and not found[2]["errors"], found[2]
