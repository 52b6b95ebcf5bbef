"""Simulated members of one membership (rlcomm.elastic) against one real store, for
``--only membership_scale`` (benchmarks/membership_scale.py).

- The store: a ``torch.distributed.TCPStore`` server (its libuv backend, torch's default) in a
  process of its own, which holds nothing else, so that its CPU is the store's.
- The members: threads in forked processes (:class:`Hosts`), each member with its own
  store connection and a heartbeat of its own (``rlcomm.elastic.Liveness.start``, whose
  ``Heartbeat`` clones that connection): what one process per member would send, without a
  process per member, which 2 cores cannot hold by the thousand. Each follows its leader with
  the library's own ``Member`` (``newer_epoch``, ``acknowledge``): the store protocol only, no
  epoch group (no gloo: an N-member group's connections are out of reach here, and not what
  this measures).
- Every store call is counted on its way out (:class:`CountingStore`), by who sent it.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, cast

import psutil
from torch import distributed as dist

from rlcomm.elastic import Keys, Liveness, Member

if TYPE_CHECKING:
    from rlcomm.context import CommContext

HOST = "127.0.0.1"
MODE = "DATA_PARALLEL"  # the membership's mode: a name only, no group is formed
TIMEOUT = datetime.timedelta(seconds=120)  # each member's store waits (acknowledge)
FOLLOW_S = 120.0  # how long a member waits for its leader's next epoch
SWITCH_S = 0.1  # the GIL's switch interval in a process holding members
REPLY_S = 300.0  # how long the measuring process waits for a process holding members
END_S = 10.0  # how long each process has to end once told to
# Who sends: the members' own calls (following epochs), their heartbeats, the leader.
ROLES = ("member", "heartbeat", "leader")
# TCPStore's get is a wait for the key, then the get: two requests on the wire.
WIRE = {"add": 1, "check": 1, "set": 1, "get": 2, "wait": 1}


class CountingStore:
    """A store that counts the requests each of its calls puts on the wire, under ``role``.
    Its clones count under ``clone_role`` (a member's heartbeat clones the member's store).
    One thread calls each: its counts need no lock, and are read as they stand."""

    def __init__(self, store: Any, role: str, clone_role: str | None = None) -> None:
        self.store, self.role, self.clone_role = store, role, clone_role or role
        self.counts = dict.fromkeys(WIRE, 0)  # every key there from the start: read safely

    def add(self, key: str, value: int) -> int:
        self.counts["add"] += 1
        return int(self.store.add(key, value))

    def check(self, keys: list[str]) -> bool:
        self.counts["check"] += 1
        return bool(self.store.check(keys))

    def set(self, key: str, value: str) -> None:
        self.counts["set"] += 1
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        self.counts["get"] += 1
        return bytes(self.store.get(key))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self.counts["wait"] += 1
        if timeout is None:
            self.store.wait(keys)
        else:
            self.store.wait(keys, timeout)

    def clone(self) -> CountingStore:
        return CountingStore(self.store.clone(), self.clone_role)

    def requests(self) -> int:
        return sum(WIRE[call] * n for call, n in self.counts.items())


def requests_by_role(stores: Sequence[CountingStore]) -> Counter[str]:
    found: Counter[str] = Counter(dict.fromkeys(ROLES, 0))
    for store in stores:
        found[store.role] += store.requests()
    return found


@dataclass(frozen=True)
class StoreOnly:
    """What ``Leader`` and ``Member`` read of a ``CommContext`` to propose, settle, follow and
    acknowledge epochs: the store, the rank, the timeout (no process group: forming an epoch's
    group is not simulated)."""

    store: Any
    rank: int
    timeout: datetime.timedelta = TIMEOUT

    def get_global_rank(self) -> int:
        return self.rank

    def context(self) -> CommContext:
        """As the classes' signatures have it: they read no more than the above."""
        return cast("CommContext", self)


class Rounds:
    """Epoch changes, as the members of one process meet them: each starts a round (as a failed
    group call would send every member to its leader's next epoch at once), and each member
    reports how it ended."""

    def __init__(self) -> None:
        self.started = threading.Condition()
        self.arrived = threading.Condition()  # apart: a report wakes the host, not every member
        self.number, self.ended = 0, False
        self.reports: list[tuple[float, str, int]] = []  # (when, outcome, members read)

    def start(self) -> None:
        with self.arrived:
            self.reports = []
        with self.started:
            self.number += 1
            self.started.notify_all()

    def end(self) -> None:
        with self.started:
            self.ended = True
            self.started.notify_all()

    def next(self, seen: int) -> int | None:
        """The round after ``seen``, once started; None once they ended."""
        with self.started:
            self.started.wait_for(lambda: self.number > seen or self.ended)
            return None if self.ended else self.number

    def report(self, number: int, outcome: str, members: int) -> None:
        """A member's end of round ``number``, stamped with ``time.monotonic`` (CLOCK_MONOTONIC:
        one clock for every process of the machine, the leader's among them)."""
        with self.arrived:
            if number == self.number:
                self.reports.append((time.monotonic(), outcome, members))
                self.arrived.notify()

    def collect(self, expected: int, timeout_s: float) -> list[tuple[float, str, int]]:
        with self.arrived:
            self.arrived.wait_for(lambda: len(self.reports) >= expected, timeout_s)
            return list(self.reports)


class SimulatedMember:
    """Member ``rank`` of ``leader``'s series ``space``: its own store connection, its
    heartbeat beating (``Liveness.start``), and a thread that follows each epoch change."""

    def __init__(self, base: Any, rank: int, leader: int, space: str) -> None:
        self.rank, self.lost = rank, False
        self.store = CountingStore(base.clone(), "member", clone_role="heartbeat")
        self.side = Member(StoreOnly(self.store, rank).context(), MODE, leader, TIMEOUT, space)
        self.liveness = Liveness(self.store, Keys(leader, space), hosts={})
        self.liveness.start(rank)

    def stores(self) -> list[CountingStore]:
        beat = self.liveness.heartbeat
        return [self.store] + ([cast(CountingStore, beat.store)] if beat is not None else [])

    def follow(self, rounds: Rounds) -> None:
        """Each round: waits for the leader's next epoch, acknowledges it and reads its settled
        members (the library's Member); ``in``, ``out`` (left out) or ``no epoch``."""
        seen = 0
        while (number := rounds.next(seen)) is not None and not self.lost:
            seen = number
            epoch = self.side.newer_epoch(FOLLOW_S)
            if epoch is None or epoch <= self.side.epoch:
                self.lost = True  # before its report: its host counts on no more of them
                rounds.report(seen, "no epoch", 0)
                return
            members = self.side.acknowledge(epoch)
            self.lost = members is None
            rounds.report(seen, "out" if members is None else "in", len(members or []))
            if members is None:
                return
            # What Member.enter keeps, without the epoch's group it would form.
            self.side.epoch, self.side.members = epoch, members

    def stop(self) -> None:
        """Its heartbeat stops for good (as when its process dies): no beat after this."""
        self.lost = True
        self.liveness.stop()
        if self.liveness.heartbeat is not None:
            self.liveness.heartbeat.thread.join()


def serve(conn: Connection) -> None:
    """The store's process: a TCPStore server, until told to end."""
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=REPLY_S))
    conn.send(store.port)
    conn.recv()


def host_members(conn: Connection, port: int, ranks: list[int], leader: int,
                 space: str) -> None:
    """A process holding the members ``ranks``, as threads, until told to end. Commands:
    ``go`` (a round), ``stop RANK`` (that member is lost), ``count``, ``end``."""
    threading.stack_size(1 << 20)  # thousands of threads; store calls need little stack
    # Every thread waiting for the GIL wakes each switch interval (5 ms) to ask for it: by the
    # hundred, that is the process's whole time. Its threads give the GIL up at every store
    # call and sleep anyway.
    sys.setswitchinterval(SWITCH_S)
    began = time.monotonic()
    base = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)
    members = {rank: SimulatedMember(base, rank, leader, space) for rank in ranks}
    rounds = Rounds()
    for member in members.values():
        threading.Thread(target=member.follow, args=(rounds,), daemon=True).start()
    conn.send(time.monotonic() - began)
    while (command := conn.recv()) != ("end",):
        if command[0] == "go":
            rounds.start()
            conn.send(rounds.collect(sum(not m.lost for m in members.values()), FOLLOW_S))
        elif command[0] == "stop":
            members[command[1]].stop()
            conn.send(True)
        elif command[0] == "count":
            conn.send(requests_by_role([s for m in members.values() for s in m.stores()]))
    rounds.end()
    for member in members.values():
        member.liveness.stop()


@dataclass(frozen=True)
class Usage:
    """What the store served up to a moment: requests sent by role, its process's CPU time and
    the responses it wrote (a cross-check of the count: a set has none); and the CPU time of
    the processes holding the members (on 2 cores, theirs and the store's compete)."""

    at: float
    requests: Counter[str]
    cpu_s: float
    responses: int
    members_cpu_s: float


class Hosts:
    """The store's process and the processes holding the members (see :func:`hosting`)."""

    def __init__(self, store: psutil.Process, port: int, conns: dict[int, Connection],
                 holders: list[psutil.Process]) -> None:
        self.store, self.port, self.holders = store, port, holders
        self.conns = conns  # member rank -> the pipe to the process holding it
        # Each process's members connected and beating: the slowest's seconds.
        self.setup_s = max(answer(conn) for conn in self.pipes())
        self.client = dist.TCPStore(HOST, port, is_master=False, timeout=TIMEOUT)

    def pipes(self) -> list[Connection]:
        """One pipe per process holding members."""
        return list({id(conn): conn for conn in self.conns.values()}.values())

    def go(self) -> None:
        """Starts a round on every process (without waiting for it); :meth:`reports` ends it."""
        for conn in self.pipes():
            conn.send(("go",))

    def reports(self) -> list[tuple[float, str, int]]:
        """Every live member's report of the round: (when, outcome, members it read)."""
        return [report for conn in self.pipes() for report in answer(conn)]

    def stop(self, rank: int) -> None:
        """Member ``rank`` is lost: its heartbeat stops, it answers no epoch."""
        self.conns[rank].send(("stop", rank))
        answer(self.conns[rank])

    def usage(self, leader: Sequence[CountingStore]) -> Usage:
        requests = requests_by_role(leader)
        for conn in self.pipes():
            conn.send(("count",))
            requests.update(answer(conn))
        return Usage(time.monotonic(), requests, _cpu_s(self.store),
                     self.store.io_counters().write_count,
                     sum(_cpu_s(holder) for holder in self.holders))


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def answer(conn: Connection) -> Any:
    """What a process holding members (or the store's) answered, within ``REPLY_S``."""
    if not conn.poll(REPLY_S):
        raise TimeoutError(f"a simulated member's process did not answer within {REPLY_S:g} s")
    return conn.recv()


@contextmanager
def hosting(n: int, processes: int, leader: int = 0, space: str = "") -> Iterator[Hosts]:
    """A store in a process of its own and members ``1..n`` of ``leader``'s series ``space``
    on ``processes`` processes (threads in each), all ended on the way out."""
    forked = get_context("fork")
    procs = []
    try:
        mine, theirs = forked.Pipe()
        server = forked.Process(target=serve, args=(theirs,), daemon=True, name="store")
        server.start()
        procs.append(server)
        port = answer(mine)
        conns: dict[int, Connection] = {}
        per = -(-n // processes)
        for first in range(1, n + 1, per):
            ranks = list(range(first, min(first + per, n + 1)))
            conn, theirs = forked.Pipe()
            proc = forked.Process(target=host_members, args=(theirs, port, ranks, leader, space),
                                  daemon=True, name=f"members-{first}")
            proc.start()
            procs.append(proc)
            conns.update(dict.fromkeys(ranks, conn))
        hosts = Hosts(psutil.Process(server.pid), port, conns,
                      [psutil.Process(proc.pid) for proc in procs[1:]])
        yield hosts
        for conn in hosts.pipes():
            conn.send(("end",))
        mine.send("end")
        for proc in procs:
            proc.join(timeout=END_S)
    finally:  # and at once when something failed: no process outlives the measurement
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def current_load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())
