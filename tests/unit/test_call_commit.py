"""rlcomm/elastic/commit.py: a call over an epoch's group (the trainers' of replica groups of
sharded trainers) is committed in the rendezvous store: it returns once every member marked it done, and
fails on a member that completed it when the group was declared broken or a member's process
ended. On a real TCPStore in this process, members in threads, a real ended process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from rlcomm.elastic import CallCommit, Keys, Liveness
from rlcomm.errors import GroupBrokenError

pytestmark = pytest.mark.unit
MEMBERS = [0, 1, 2]


KEYS = Keys(0, "trainers/")


def key(name: str) -> str:
    return KEYS.key(name)


@pytest.fixture
def store() -> dist.Store:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def commit_of(store: dist.Store, rank: int, pids: dict[int, int]) -> CallCommit:
    for member, pid in pids.items():
        store.set(key(f"process/{member}"), str(pid))
    liveness = Liveness(store, KEYS, dict.fromkeys(MEMBERS, socket.gethostname()))
    liveness.note(MEMBERS)
    return CallCommit(store, KEYS, rank, liveness, lambda: 0, lambda: MEMBERS)


def run_all(commits: dict[int, CallCommit]) -> dict[int, str]:
    outcome: dict[int, str] = {}

    def run(rank: int) -> None:
        try:
            commits[rank].commit()
            outcome[rank] = "done"
        except GroupBrokenError:
            outcome[rank] = "failed"

    threads = [threading.Thread(target=run, args=(rank,)) for rank in commits]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcome


def test_a_call_every_member_completed_is_committed(store: dist.Store) -> None:
    pids = dict.fromkeys(MEMBERS, os.getpid())
    commits = {rank: commit_of(store, rank, pids) for rank in MEMBERS}
    assert run_all(commits) == dict.fromkeys(MEMBERS, "done")
    assert run_all(commits) == dict.fromkeys(MEMBERS, "done")  # the next call, numbered apart
    assert {c.calls for c in commits.values()} == {2}


def test_a_call_fails_where_it_completed_once_the_group_is_declared_broken(
    store: dist.Store,
) -> None:
    pids = dict.fromkeys(MEMBERS, os.getpid())
    commits = {rank: commit_of(store, rank, pids) for rank in (0, 1)}
    store.set(key("broken/0"), "connection closed")  # rank 2's call failed: it never commits
    assert run_all(commits) == {0: "failed", 1: "failed"}


def test_a_member_whose_process_ended_is_declared_lost(store: dist.Store) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(timeout=60)
    pids = {0: os.getpid(), 1: os.getpid(), 2: ended.pid}
    commits = {rank: commit_of(store, rank, pids) for rank in (0, 1)}
    assert run_all(commits) == {0: "failed", 1: "failed"}
    assert "rank(s) [2] left during call 1" in store.get(key("broken/0")).decode()
