"""Run a function on N real processes with a gloo-ready environment on 127.0.0.1.

For tests and benchmarks of code built on rlcomm (a loop, a collective pattern).

Processes are forked (the parent already imported torch, so each rank starts in milliseconds),
joined with a deadline that catches hangs, and checked to have ended.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from rlcomm.context import CommContext
    from rlcomm.plan.layout import LayoutPlan

DEFAULT_TIMEOUT_S = 180.0


@contextlib.contextmanager
def planned_context(plan: LayoutPlan, timeout: int = 120) -> Iterator[CommContext]:
    """On a rank of :func:`run_ranks`: a gloo context with every group of ``plan``, destroyed
    on the way out."""
    from rlcomm.context import CommContext

    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=timeout)
    ctx.init_groups(plan)
    try:
        yield ctx
    finally:
        ctx.destroy()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now, below the kernel's ephemeral range where it
    can: an outgoing connection takes its local port from that range, and could take this one
    before the rank it is meant for binds it (seen in CI: ``Address already in use``)."""
    lowest = _ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(100 if lowest > _LOWEST_PICKED + 1000 else 0):
        port = pick.randrange(_LOWEST_PICKED, lowest)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_LOWEST_PICKED = 10000  # above the well-known and most registered services' ports


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, queue: Any, args: tuple[Any, ...]
) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException as err:
        queue.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    expect_failure: bool = False,
    start_method: str = "fork",
) -> dict[int, Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` forked processes.

    Returns ``{rank: return value}``. A rank that raises fails the call with its traceback
    (unless ``expect_failure``, then ``{rank: "error text"}`` for the ranks that raised); a run
    that exceeds ``timeout`` kills every rank and fails.
    """
    ctx: Any = mp.get_context(start_method)  # "spawn": CUDA must start fresh in each rank
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, fn, world_size, port, queue, args), daemon=True)
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish within {timeout}s: {_states(procs)}")
            if not queue.empty():
                rank, status, value = queue.get()
                (results if status == "ok" else errors)[rank] = value
                continue
            if errors and all(not p.is_alive() for p in procs):
                break  # the others died too (e.g. a peer's failure broke their collective)
            time.sleep(0.02)
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    assert not any(p.is_alive() for p in procs), f"ranks left running: {_states(procs)}"
    if errors and not expect_failure:
        raise AssertionError("\n".join(f"rank {r} failed: {e}" for r, e in sorted(errors.items())))
    if expect_failure:
        return errors
    return results


def _states(procs: list[Any]) -> str:
    return ", ".join(
        f"rank {i}: {'alive' if p.is_alive() else p.exitcode}" for i, p in enumerate(procs)
    )
