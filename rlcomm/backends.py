"""The backends a context can run on, and how ``auto`` is resolved. Torch-free until resolved."""

from __future__ import annotations

from enum import Enum

from rlcomm.errors import BackendError


class Backend(str, Enum):
    """gloo (CPU), nccl (CUDA) or auto (nccl where CUDA devices are visible, else gloo)."""

    nccl = "nccl"
    gloo = "gloo"
    auto = "auto"


# torch's fake backend: simulated ranks for planning at scale (tests, benchmarks), never a choice
# a user makes.
FAKE = "fake"


def resolve_backend(backend: str) -> str:
    """``auto`` -> nccl with CUDA devices, else gloo; nccl without CUDA is an error naming gloo."""
    import torch

    if backend == Backend.auto:
        return Backend.nccl.value if torch.cuda.is_available() else Backend.gloo.value
    if backend == Backend.nccl and not torch.cuda.is_available():
        raise BackendError(
            "backend 'nccl' needs CUDA devices but none are visible on this machine; "
            "use backend='gloo' (or 'auto')"
        )
    if backend not in (Backend.nccl, Backend.gloo, FAKE):
        raise BackendError(
            f"backend {backend!r} is not one of {', '.join(b.value for b in Backend)}"
        )
    return FAKE if backend == FAKE else Backend(backend).value
