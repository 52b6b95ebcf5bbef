"""Rendezvous: the store every rank joins before the default group exists.

Beyond what ``env://`` does, it (1) binds a master store to the given address only (a loopback
run listens on 127.0.0.1, not on every interface) and points gloo's sockets at the interface that
reaches it (see ``interfaces``), (2) keeps one store
per address for the whole process and namespaces each init with a fresh prefix, so init -> destroy
-> init reuses no stale keys, and (3) waits for every rank with the init timeout and, if some never
arrive, says which on every rank that did (the host keeps the store up until they have read it).
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import torch.distributed as dist

from rlcomm.errors import JoinTimeoutError
from rlcomm.net import env
from rlcomm.net.interfaces import choose_socket_interfaces, is_loopback, socket_address
from rlcomm.utils import format_ranks


@dataclass(frozen=True)
class StoreLocation:
    """Where a job's rendezvous store is, and the prefix its keys live under in it: what a
    process outside the job needs to reach them (:func:`connect_store`)."""

    host: str
    port: int
    prefix: str


_stores: dict[tuple[str, int, int], dist.Store] = {}
_location: list[StoreLocation] = []  # the last TCP store this process joined a world on
_listeners: list[socket.socket] = []
_hosted: list[dist.Store] = []  # the stores this process serves (it is their rank 0)
_generation = 0
# After a join timeout, the rank hosting the store keeps it up this long at most, so the ranks that
# arrived (and so time out) after it can still read who is missing; it leaves as soon as they have.
_REPORT_GRACE_S = 30.0


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
    # torchrun's shared agent store outlives worker restarts: the restart count keeps attempts
    # apart there. A store hosted by rank 0 is new on every attempt, and the restart count of a
    # host restarted by hand (a new torchrun, count 0) differs from the others' anyway.
    attempt = env.restart_count() if env.uses_agent_store() else 0
    prefix = f"rlcomm/{attempt}/{_generation}/"
    store = dist.PrefixStore(prefix, base)
    if isinstance(base, dist.TCPStore):
        _location[:] = [StoreLocation(base.host, base.port, prefix)]
    _wait_for_ranks(store, rank, world_size, timeout, hosts_store=base in _hosted)
    return store


def store_location() -> StoreLocation | None:
    """Where the store of this process's last world is (None: not a TCP store)."""
    return _location[0] if _location else None


def connect_store(location: StoreLocation, timeout: datetime.timedelta) -> dist.Store:
    """A client of the job's store at ``location``, seeing its keys as the job's ranks do; raises
    (DistStoreError, RuntimeError) when it cannot be reached within ``timeout``."""
    base = dist.TCPStore(location.host, location.port, None, False, timeout)
    return dist.PrefixStore(location.prefix, base)


def serves_store() -> bool:
    """Whether this process serves a rendezvous store (it is rank 0 of a job it joined): the
    store, and every rank's access to it, ends when this process does."""
    return bool(_hosted)


def _base_store(
    dist_url: str, rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.Store:
    url = urlparse(dist_url)
    if url.scheme == "env":
        host, port = env.master_address()
    elif url.scheme == "tcp" and url.hostname and url.port:
        host, port = url.hostname, url.port
    else:  # file:// and anything else torch knows
        store, _, _ = next(dist.rendezvous(dist_url, rank, world_size, timeout=timeout))
        return store
    local = env.local_world_size()
    spans_hosts = local is not None and local < world_size
    choose_socket_interfaces(host, spans_hosts)
    key = (host, port, rank)
    if key not in _stores:
        _stores[key] = _tcp_store(host, port, rank, world_size, timeout, spans_hosts)
    return _stores[key]


def _tcp_store(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    spans_hosts: bool,
) -> dist.TCPStore:
    if spans_hosts and is_loopback(host):
        # The store's host: its own name maps to loopback here (Debian's 127.0.1.1), while the
        # other hosts reach it by its real address. Serve and connect there, on the interface
        # chosen for gloo.
        host = socket_address() or host
    # Under torchrun the agent hosts the store already; every worker is a client.
    is_master = rank == 0 and not env.uses_agent_store()
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    listener = socket.create_server((host, port), backlog=4096, reuse_port=False)
    _listeners.append(listener)  # the store serves on this socket for the process's lifetime
    store = dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    _hosted.append(store)
    return store


def _wait_for_ranks(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    hosts_store: bool = False,
) -> None:
    store.set(f"arrived/{rank}", "1")
    keys = [f"arrived/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
        return
    except Exception as err:  # torch raises DistStoreError or RuntimeError depending on version
        failure = err
    seconds = timeout.total_seconds()
    try:
        arrived = [r for r in range(world_size) if store.check([f"arrived/{r}"])]
    except Exception:
        # The store's host gave up (or died) before this rank could ask who is missing.
        raise JoinTimeoutError(
            f"rank {rank}: the rendezvous store (served by rank 0) closed before all "
            f"{world_size} ranks joined (timeout {seconds:g}s); rank 0's error names the "
            "ranks that never joined"
        ) from failure
    missing = sorted(set(range(world_size)) - set(arrived))
    if hosts_store:
        _keep_store_for_readers(store, len(arrived) - 1, _REPORT_GRACE_S)
    else:
        with contextlib.suppress(Exception):
            store.add("timeout/readers", 1)  # tell the host this rank has read the store
    raise JoinTimeoutError(
        f"rank {rank}: ranks {format_ranks(missing)} never joined within "
        f"{seconds:g}s; arrived: {format_ranks(arrived)} of {world_size}"
    ) from failure


def _keep_store_for_readers(store: dist.Store, readers: int, grace_s: float) -> None:
    """Serve the store until ``readers`` other ranks read who is missing, or ``grace_s`` passes;
    without this, the host's exit would leave them a closed store and no list of missing ranks."""
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(Exception):
        while store.add("timeout/readers", 0) < readers and time.monotonic() < deadline:
            time.sleep(0.1)
