"""Checksums of tensors' exact bytes, and the helper thread that sums half of a large buffer.

The helper honours the CPU budget the process declared: it is used only while
``torch.get_num_threads() > 1`` (a rank that asked torch for one thread, as PPO's do, stays on
one), it belongs to one :class:`ChecksumHelper` (each sender and receiver owns one) and it stops
on :meth:`ChecksumHelper.close`, or when its owner is garbage-collected.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

import torch
from torch import Tensor

PARALLEL_CHECKSUM_BYTES = 1 << 20  # below this, handing half to a thread costs more than it saves
THREAD_NAME = "rlcomm-checksum"  # the helper thread's name prefix (as threading.enumerate() shows)


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


# A view's bytes split for summing: its whole 64-bit words and the bytes after them, or the view
# itself when its words are not 8-byte aligned in memory (then summed as an aligned copy).
ChecksumParts = tuple[Tensor, Tensor] | Tensor


def checksum_parts(view: Tensor) -> ChecksumParts:
    raw = view.reshape(-1).view(torch.uint8)
    body = raw.numel() // 8 * 8
    try:
        return raw[:body].view(torch.int64), raw[body:]
    except RuntimeError:  # not 8-byte aligned in its storage
        return view


def halves(sizes: list[int]) -> tuple[list[int], list[int]]:
    """Indices of ``sizes`` in two groups of about equal sums (largest first, to the lighter)."""
    groups: tuple[list[int], list[int]] = ([], [])
    totals = [0, 0]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lighter = 0 if totals[0] <= totals[1] else 1
        groups[lighter].append(i)
        totals[lighter] += sizes[i]
    return groups


def _checksum_of(parts: ChecksumParts) -> Tensor:
    if isinstance(parts, Tensor):
        return torch.tensor(tensor_checksum(parts), dtype=torch.int64)
    words, tail = parts
    # int64 sums wrap like the checksum's 64-bit words; an empty sum is 0.
    return words.sum() + tail.sum() if tail.numel() else words.sum()


class ChecksumHelper:
    """One helper thread that sums half of a large CPU buffer's checksums, started on first use.

    A process that declared one thread to torch (``torch.set_num_threads(1)``) gets none: each
    :meth:`executor` call asks torch again. One core sums at a fraction of the memory's
    bandwidth, and during a verification the peer's core is idle (it waits for these checksums),
    so where two threads are allowed they halve the time. A helper inherited through ``fork``
    starts a thread of its own (the parent's does not exist in the child). Mind torch's own
    fork hazard: once a parent ran a large torch op on two threads, a forked child that declares
    two hangs in its first such op (libgomp's thread team is the parent's): spawn it instead.
    """

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0  # the process self._pool's thread belongs to

    def executor(self) -> ThreadPoolExecutor | None:
        """The helper thread's executor, or None where the process declared a single thread."""
        if torch.get_num_threads() <= 1:
            return None
        if self._pool is None or self._pid != os.getpid():
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME)
            self._pid = os.getpid()
        return self._pool

    def close(self) -> None:
        """Stop the helper thread (waits for it); a later :meth:`executor` starts a new one."""
        pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)

    def __enter__(self) -> ChecksumHelper:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def batched_checksums(
    parts: Sequence[ChecksumParts],
    split: tuple[list[int], list[int]],
    two_threads: bool,
    helper: ChecksumHelper | None,
) -> Tensor:
    """Each part's checksum, in order, as one int64 tensor; with ``two_threads`` (and a process
    that allows it) the indices ``split[1]`` are summed by ``helper``'s thread while this one
    sums ``split[0]``. Without a helper, one lives for this call only."""
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    if two_threads and helper is None and torch.get_num_threads() > 1:
        with ChecksumHelper() as own:
            return batched_checksums(parts, split, two_threads, own)
    sums: list[Tensor] = [torch.zeros((), dtype=torch.int64)] * len(parts)

    def run(indices: list[int]) -> None:
        for i in indices:
            sums[i] = _checksum_of(parts[i])

    executor = helper.executor() if two_threads and helper is not None else None
    if executor is None:
        run(list(range(len(parts))))
    else:
        mine, theirs = split
        done = executor.submit(run, theirs)
        run(mine)
        done.result()
    return torch.stack(sums)
