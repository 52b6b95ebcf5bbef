"""rlcomm.elastic's EpochRecords.confirm with ``along``: members that answered leave with the
missing ones (a lost rank's replica group, app/runtime/membership/trainers.py), and each reads that it
is out. On a real store in this process (torch's HashStore), members answering from threads."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from rlcomm.elastic import EpochRecords, acknowledge

pytestmark = pytest.mark.unit
LEADER = 0


def test_members_along_with_a_missing_one_are_out_and_read_it() -> None:
    store = dist.HashStore()
    membership = EpochRecords(store, LEADER, planned=[0, 1, 2, 3])
    epoch = membership.announce([1, 2, 3], [])
    answers: dict[int, list[int] | None] = {}

    def answer(rank: int) -> None:
        answers[rank] = acknowledge(store, LEADER, epoch, rank, datetime.timedelta(seconds=30))

    threads = [threading.Thread(target=answer, args=(rank,)) for rank in (1, 3)]  # 2 is lost
    for thread in threads:
        thread.start()
    missing = membership.confirm(
        10.0, gone=lambda waiting: [r for r in waiting if r == 2],
        along=lambda lost: [r for block in ((0, 1), (2, 3)) if set(block) & set(lost)
                            for r in block])
    for thread in threads:
        thread.join(timeout=30)
    assert missing == [2, 3]
    assert membership.members == [1]
    assert answers == {1: [0, 1], 3: None}


def test_without_along_only_the_missing_leave() -> None:
    store = dist.HashStore()
    membership = EpochRecords(store, LEADER, planned=[0, 1, 2])
    epoch = membership.announce([1, 2], [])
    store.set(f"elastic/{LEADER}/ack/{epoch}/1", "1")
    assert membership.confirm(0.05) == [2]
    assert membership.members == [1]
