"""Whether a member's process lives, as its leader asks when their group failed: each member's
heartbeat, a store counter a thread of it advances every ``BEAT_S`` under a key of its own
process (a replacement's beats are not its predecessor's), and, for a process on the leader's
own host, the process itself (at once)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from rlcomm.elastic.keys import Keys

BEAT_S = 0.2  # how often each member beats its heartbeat
BEAT_LOST_S = 1.5  # a member that did not answer and whose heartbeat stood still this long is lost


def process_ended(pid: int) -> bool:
    """Whether the process ``pid`` of this host has ended (gone, or a zombie its parent has not
    reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class Heartbeat:
    """A counter in the store that a thread of this member advances every ``BEAT_S``, over a
    connection of its own (the main thread's store calls may wait long). A stopped or killed
    process stops it."""

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store.clone(), key
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="rlcomm-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopping.wait(BEAT_S):
            try:
                self.store.add(self.key, 1)
            except RuntimeError:  # the store is gone: the run ended
                return

    def stop(self) -> None:
        self.stopping.set()


class Liveness:
    """The members' processes as one of them sees them. ``keys``: their series' store keys;
    ``hosts``: rank -> host, as the membership keeps it."""

    def __init__(self, store: Any, keys: Keys, hosts: dict[int, str]) -> None:
        self.store, self.keys, self.hosts = store, keys, hosts
        self.processes: dict[int, int] = {}  # rank -> pid, of the current epoch
        self.heartbeat: Heartbeat | None = None

    def start(self, rank: int) -> None:
        """This process, as ``rank``: published, and its heartbeat beating."""
        self.store.set(self.keys.process(rank), str(os.getpid()))
        self.heartbeat = Heartbeat(self.store, self.keys.beat(rank, os.getpid()))

    def note(self, members: list[int]) -> None:
        """The processes of a new epoch's ``members`` (each published its own before)."""
        self.processes = {r: int(self.store.get(self.keys.process(r))) for r in members}

    def watch(self, ranks: list[int]) -> Callable[[list[int]], list[int]]:
        """From now: ``gone(waiting)``, those of ``waiting`` (among ``ranks``) whose process on
        this host has ended, or whose heartbeat stood still for ``BEAT_LOST_S``."""
        beats, since = {r: self._beat_of(r) for r in ranks}, time.monotonic()

        def gone(waiting: list[int]) -> list[int]:
            still = time.monotonic() - since > BEAT_LOST_S
            return [r for r in waiting if self._ended_here(r)
                    or (still and self._beat_of(r) == beats[r])]

        return gone

    def stop(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def _ended_here(self, rank: int) -> bool:
        if self.hosts.get(rank) != socket.gethostname():
            return False
        return process_ended(self.processes[rank])

    def _beat_of(self, rank: int) -> int:
        return int(self.store.add(self.keys.beat(rank, self.processes[rank]), 0))
