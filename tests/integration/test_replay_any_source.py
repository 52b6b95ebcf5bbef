"""What a replay server's receive relies on with elastic rollout ranks
(app/runtime/replay/service.py): on real gloo processes over 127.0.0.1, a receive from any rank
of a group goes on receiving from the others when a member of the group is SIGKILLed, whether
the dead one had sent before or not; only its own connection closes. The REPLAY group holds
the rollout ranks, one of which may die while the replay server waits on it.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import distributed as dist

from rlcomm.testing import free_port

pytestmark = pytest.mark.integration

WORLD, FROM_LIVE, FROM_DEAD = 4, 12, 3  # rank 0 receives; 1 lives; 2 and 3 are killed


def _rank(rank: int, port: int, received: mp.SimpleQueue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=20))
    group = dist.new_group(list(range(WORLD)))  # as REPLAY: every rank
    message = torch.zeros(2)
    if rank == 0:
        sources = []
        for _ in range(FROM_LIVE + FROM_DEAD):  # blocks across both deaths
            sources.append(dist.recv(message, group=group, tag=1))
        received.put(sources)
        return
    if rank == 2:  # a writer that sent, then dies
        for _ in range(FROM_DEAD):
            dist.send(torch.full((2,), 2.0), dst=0, group=group, tag=1)
    if rank in (2, 3):  # rank 3 dies without ever sending
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # both are dead before the survivor sends
    for _ in range(FROM_LIVE):
        dist.send(torch.ones(2), dst=0, group=group, tag=1)
        time.sleep(0.02)
    time.sleep(0.5)  # until rank 0 has read everything: no close under its last receive


def test_a_receive_from_any_rank_outlives_a_killed_member() -> None:
    ctx = mp.get_context("fork")
    received = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, received), daemon=True)
             for r in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(60)
        assert [p.exitcode for p in procs] == [0, 0, -signal.SIGKILL, -signal.SIGKILL]
        sources = received.get()
        assert sorted(sources) == [1] * FROM_LIVE + [2] * FROM_DEAD, sources
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
