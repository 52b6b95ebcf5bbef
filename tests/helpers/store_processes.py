"""Processes that share a TCPStore hosted by the test process, so that the store outlives any of
them (a leader that ends does not take the side channel with it): the runner of the elastic
groups' and the trainers' group tests. The processes meet on the store before ending, so none
closes its gloo connections while a peer may still read from them, and each is checked to have
ended with the exit code it should."""

from __future__ import annotations

import datetime
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import distributed as dist

from rlcomm.testing import free_port

STORE_TIMEOUT = datetime.timedelta(seconds=60)
DEADLINE_S = 120.0  # one run of processes, whatever happens in it
ERROR_GRACE_S = 3.0  # after a process failed, how long the others get before they are killed
HOST = "127.0.0.1"


def meet(store: dist.Store, key: str, count: int) -> None:
    """Wait on the store until ``count`` processes arrived at ``key``."""
    store.add(key, 1)
    deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
    while int(store.add(key, 0)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: {store.add(key, 0)} of {count} processes arrived")
        time.sleep(0.01)


def _entry(rank: int, fn: Callable[..., Any], port: int, finishing: int, queue: Any,
           args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # forked: no OpenMP team of the parent's
    try:
        store = dist.TCPStore(HOST, port, None, False, STORE_TIMEOUT)
        result = fn(rank, store, *args)
    except BaseException as err:
        queue.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise
    queue.put((rank, "ok", result))
    # Nobody leaves (closing its gloo connections) while a peer may still read from them.
    meet(store, "test/finished", finishing)


def run_processes(fn: Callable[..., Any], count: int, *args: Any,
                  exits: Mapping[int, int] | None = None) -> dict[int, Any]:
    """``fn(rank, store, *args)`` in ``count`` forked processes sharing a TCPStore hosted here;
    returns ``{rank: result}``. ``exits``: ranks that end abruptly (os._exit), with their exit
    code. Any failure, a wrong exit code or a missing result fails; every process has ended when
    this returns or raises."""
    exits = dict(exits or {})
    context: Any = mp.get_context("fork")
    queue = context.SimpleQueue()
    port = free_port()
    procs = [
        context.Process(target=_entry, daemon=True,
                        args=(rank, fn, port, count - len(exits), queue, args))
        for rank in range(count)
    ]
    for proc in procs:
        proc.start()
    # Hosted here, after the fork (the clients retry until it listens): it outlives them all.
    store = dist.TCPStore(HOST, port, None, True, STORE_TIMEOUT, wait_for_workers=False)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + DEADLINE_S
    failed_at: float | None = None
    timed_out = False
    try:
        while any(p.is_alive() for p in procs) or not queue.empty():
            while not queue.empty():
                rank, status, value = queue.get()
                (results if status == "ok" else errors)[rank] = value
            now = time.monotonic()
            if errors and failed_at is None:
                failed_at = now
            if failed_at is not None and now > failed_at + ERROR_GRACE_S:
                break  # the others would wait for the failed one: a failure, not a hang
            if now > deadline:
                timed_out = True
                break
            time.sleep(0.02)
    finally:
        states = ", ".join(f"{r}: {'alive' if p.is_alive() else p.exitcode}"
                           for r, p in enumerate(procs))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(10)
        del store
    assert not any(p.is_alive() for p in procs), "processes left running"
    problems = [f"rank {r} failed: {e}" for r, e in sorted(errors.items())]
    if timed_out:
        problems.append(f"not ended within {DEADLINE_S:g} s ({states})")
    if not problems:
        for rank, proc in enumerate(procs):
            if proc.exitcode != exits.get(rank, 0):
                problems.append(f"rank {rank} exited with {proc.exitcode}, "
                                f"expected {exits.get(rank, 0)}")
            elif rank not in exits and rank not in results:
                problems.append(f"rank {rank} ended without a result")
    assert not problems, "\n".join(problems)
    return results
