"""The weight checksums' helper thread (rlcomm/weights/checksums.py), seen from a test: how many
threads this process declares, and which helper threads run (tests/unit/test_weight_checksums.py,
tests/integration/test_weight_async.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from rlcomm.weights.checksums import THREAD_NAME


@contextlib.contextmanager
def declared_threads(count: int) -> Iterator[None]:
    """This process declares ``count`` threads to torch (as a rank does), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def helper_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]
