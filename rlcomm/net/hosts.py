"""Where the ranks run: every rank's host, agreed over the rendezvous store before any group.

The layout's notion of a node is only a plan; the hosts the launcher actually put the ranks on
decide (see :func:`rlcomm.plan.layout.place_on_hosts`). Exchanged over the store, as plain strings,
so it costs no collective and works before any group exists. Knowing each rank's host and
address also lets a rank that loses a peer say which host went away.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from rlcomm.collectives import barrier
from rlcomm.context import CommContext
from rlcomm.modes import CommMode
from rlcomm.net.gloo_words import peer_addresses, says_peer_closed_or_timed_out
from rlcomm.net.interfaces import socket_address
from rlcomm.net.rendezvous import serves_store
from rlcomm.plan.layout import LayoutPlan, place_on_hosts
from rlcomm.utils import format_ranks

_T = TypeVar("_T")


@dataclass(frozen=True)
class Hosts:
    """Each rank's host name and the address its sockets use, indexed by rank."""

    names: tuple[str, ...]
    addresses: tuple[str, ...]

    def ranks_on(self, name: str) -> list[int]:
        return [rank for rank, host in enumerate(self.names) if host == name]

    def describe(self, hosts: list[str]) -> str:
        return ", ".join(f"{h} (ranks {format_ranks(self.ranks_on(h))})" for h in hosts)


def lost_hosts(ctx: CommContext, hosts: Hosts, error: BaseException) -> list[str] | None:
    """The other hosts a failed collective lost (describe them with :meth:`Hosts.describe`),
    or None when ``error`` is not a lost connection to another host.

    A peer that died closes its sockets, and gloo names its address. A peer on this rank's own
    host that closed its sockets may have left because it lost another host: then the verdict it
    published (:func:`announce_lost`) names that host. A link that went down only times out:
    then the heartbeats every rank of a multi-host run leaves in the store tell which hosts fell
    silent (all their ranks stopped beating); if the store itself is out of reach, the host that
    serves it (rank 0's) is the one lost.
    """
    me = ctx.get_global_rank()
    text = " | ".join(str(e) for e in _causes(error))  # a HangError wraps gloo's own error
    for address in peer_addresses(text):
        owners = sorted({hosts.names[r] for r, a in enumerate(hosts.addresses) if a == address})
        if owners and hosts.names[me] not in owners:
            return owners
    if not says_peer_closed_or_timed_out(text) or len(set(hosts.names)) < 2:
        return None
    heard = [h for h in _heard if h != hosts.names[me]]
    if heard:
        return heard
    silent = _within(10 * _BEAT_S, _silent_ranks, None, ctx.store, len(hosts.names))
    if silent is None:
        return [hosts.names[0]] if hosts.names[0] != hosts.names[me] else None
    gone = [h for h in dict.fromkeys(hosts.names)
            if h != hosts.names[me] and set(hosts.ranks_on(h)) <= set(silent)]
    return gone or None


def announce_lost(ctx: CommContext, hosts: Hosts, lost: list[str]) -> None:
    """Publish that ``lost`` hosts are gone, for the ranks that will only see this rank leave.

    A rank blocked on a peer of its own host (a DDP all_reduce, say) learns nothing of the lost
    host but that its peer closed the connection, and when that peer served the store, the store
    is gone too. So every rank's heartbeat reads the verdict as soon as one is published, and the
    process serving the store waits (a few beats at most) until the other survivors have read
    it before it leaves.
    """
    gone = {r for h in lost for r in hosts.ranks_on(h)}
    readers = len(hosts.names) - len(gone) - 1

    def publish() -> None:
        with contextlib.suppress(Exception):  # the store may be what was lost
            ctx.store.set(_VERDICT, " ".join(lost))
            if not serves_store():
                return
            deadline = time.monotonic() + 3 * _BEAT_S
            while ctx.store.add(_VERDICT_READ, 0) < readers and time.monotonic() < deadline:
                time.sleep(0.1)

    _within(5 * _BEAT_S, publish, None)


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and what it was raised from, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


_BEAT_S = 1.0  # heartbeat period; a host is silent after 3 periods without a beat
_VERDICT, _VERDICT_READ = "lost", "lost/read"  # store keys of announce_lost
_heard: list[str] = []  # the lost hosts another rank announced, as this rank's heartbeat read them


def _within(seconds: float, fn: Callable[..., _T], default: _T, *args: Any) -> _T:
    """``fn(*args)``, or ``default`` when it does not return within ``seconds``.

    For the store calls of a rank that lost a host. A link that went down drops packets
    instead of closing the connection, and the heartbeat's and the watchdog's calls on the same
    client, made with the store's long timeout, hold it first: a call with its own short
    timeout still waits behind them. The call left behind runs on a daemon thread, which ends
    with the process."""
    outcome: list[_T] = []
    worker = threading.Thread(target=lambda: outcome.append(fn(*args)), daemon=True,
                              name="rlcomm-bounded-store-call")
    worker.start()
    worker.join(seconds)
    return outcome[0] if outcome else default


def _silent_ranks(store: dist.Store, world: int) -> list[int] | None:
    """Ranks whose heartbeat did not move for 3 periods; None if the store is out of reach."""
    keys = [f"beat/{r}" for r in range(world)]
    try:
        store.set_timeout(datetime.timedelta(seconds=5 * _BEAT_S))
        first = [store.add(k, 0) for k in keys]
        time.sleep(3 * _BEAT_S)
        second = [store.add(k, 0) for k in keys]
    except Exception:  # DistStoreError or RuntimeError depending on torch version
        return None
    return [r for r in range(world) if first[r] == second[r]]


_stop_beats = threading.Event()


def _start_heartbeat(ctx: CommContext) -> None:
    _heard.clear()  # a verdict of an earlier init (a restart in this process) is not news
    beat = threading.Thread(target=_beat, args=(ctx, ctx.store, ctx.get_global_rank()),
                            name="rlcomm-heartbeat", daemon=True)
    beat.start()

    def stop() -> None:  # a thread inside a store call while Python shuts down aborts it
        _stop_beats.set()
        beat.join(timeout=10)

    atexit.register(stop)


def _beat(ctx: CommContext, store: dist.Store, rank: int) -> None:
    """Count up this rank's heartbeat in the store while ``ctx`` lives on it, and read the
    verdict of :func:`announce_lost` once one is published (daemon thread)."""
    key = f"beat/{rank}"
    try:
        while ctx.is_initialized() and ctx.store is store and not _stop_beats.is_set():
            store.add(key, 1)
            if not _heard and store.check([_VERDICT]):
                _heard.extend(store.get(_VERDICT).decode().split())
                store.add(_VERDICT_READ, 1)
            _stop_beats.wait(_BEAT_S)
    except Exception:
        return  # the run is over (the store's host left) or failing: nothing left to tell


def gather_hosts(ctx: CommContext, host: str | None = None) -> Hosts:
    """Every rank's host name (``socket.gethostname()`` unless given) and socket address."""
    store = ctx.store
    rank, world = ctx.get_global_rank(), ctx.get_world_size(CommMode.GLOBAL)
    store.set(f"host/{rank}", f"{host or socket.gethostname()} {socket_address()}")
    keys = [f"host/{r}" for r in range(world)]
    store.wait(keys)
    entries = [value.decode().split(" ", 1) for value in store.multi_get(keys)]
    # Nobody leaves (e.g. on a mismatch, the store's host among them) before all have read.
    barrier(ctx, CommMode.GLOBAL)
    return Hosts(tuple(e[0] for e in entries), tuple(e[1] if len(e) > 1 else "" for e in entries))


def agree_on_hosts(
    ctx: CommContext, plan: LayoutPlan, host: str | None = None, simulated_nodes: bool = False
) -> tuple[LayoutPlan, Hosts]:
    """``plan`` checked against the hosts the ranks run on (its node groups fitted to them when
    it leaves nodes open), and the hosts by rank. Call after ``init_distributed_env``, before
    creating the plan's groups; a mismatch raises the same one-line LayoutError on every rank.

    ``simulated_nodes``: the ranks were deliberately started on one machine (the app's own local
    launcher), so a layout's declared nodes are kept as simulated nodes instead of checked.
    """
    if ctx.backend == "fake":  # one process simulating every rank: no hosts to ask
        name = host or socket.gethostname()
        return plan, Hosts((name,) * plan.world_size, ("",) * plan.world_size)
    hosts = gather_hosts(ctx, host)
    if not (simulated_nodes and plan.nodes_declared):
        plan = place_on_hosts(plan, hosts.names)
    if len(set(hosts.names)) > 1:
        _start_heartbeat(ctx)
    return plan, hosts
