"""Rendezvous: the store every rank joins before the default group exists.

Beyond what ``env://`` does, it (1) binds a master store to the given address only (a loopback
run listens on 127.0.0.1, not on every interface), (2) keeps one store per address for the whole
process and namespaces each init with a fresh prefix, so init -> destroy -> init reuses no stale
keys, and (3) waits for every rank with the init timeout and, if some never arrive, says which.
"""

from __future__ import annotations

import datetime
import os
import socket
from urllib.parse import urlparse

import torch.distributed as dist

from .errors import EnvironmentConfigError, JoinTimeoutError
from .utils import env_int, format_ranks

_stores: dict[tuple[str, int, int], dist.Store] = {}
_listeners: list[socket.socket] = []
_generation = 0


def join_world(
    backend: str, dist_url: str, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.Store:
    """A store on which all ``world_size`` ranks have arrived, private to this init."""
    global _generation
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        return FakeStore()
    base = _base_store(dist_url, rank, world_size, timeout)
    _generation += 1
    # Agent stores outlive worker restarts; the restart count keeps attempts apart.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"rlcomm/{attempt}/{_generation}/", base)
    _wait_for_ranks(store, rank, world_size, timeout)
    return store


def _base_store(
    dist_url: str, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.Store:
    url = urlparse(dist_url)
    if url.scheme == "env":
        host = os.environ.get("MASTER_ADDR")
        if not host:
            raise EnvironmentConfigError("environment variable MASTER_ADDR is not set (env://)")
        port = env_int("MASTER_PORT")
    elif url.scheme == "tcp" and url.hostname and url.port:
        host, port = url.hostname, url.port
    else:  # file:// and anything else torch knows
        store, _, _ = next(dist.rendezvous(dist_url, rank, world_size, timeout=timeout))
        return store
    key = (host, port, rank)
    if key not in _stores:
        _stores[key] = _tcp_store(host, port, rank, world_size, timeout)
    return _stores[key]


def _tcp_store(
    host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    # Under torchrun the agent hosts the store already; every worker is a client.
    is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    listener = socket.create_server((host, port), backlog=4096, reuse_port=False)
    _listeners.append(listener)  # the store serves on this socket for the process's lifetime
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )


def _wait_for_ranks(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> None:
    store.set(f"arrived/{rank}", "1")
    keys = [f"arrived/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except Exception as err:  # torch raises DistStoreError or RuntimeError depending on version
        arrived = [r for r in range(world_size) if store.check([f"arrived/{r}"])]
        missing = sorted(set(range(world_size)) - set(arrived))
        raise JoinTimeoutError(
            f"rank {rank}: ranks {format_ranks(missing)} never joined within "
            f"{timeout.total_seconds():g}s; arrived: {format_ranks(arrived)} of {world_size}"
        ) from err
