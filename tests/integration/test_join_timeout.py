"""Joining (CommContext.init_distributed_env) on real gloo ranks forked from here: ranks that
arrive after the store's host gave up still learn, and name, the rank that never joined. The
same through ``python -m app`` is tests/e2e/test_reliability.py."""

from __future__ import annotations

import time

import pytest

from rlcomm.testing import run_ranks

pytestmark = pytest.mark.integration


def _join_late(rank: int, world_size: int, delays: list[float], timeout_s: int) -> None:
    from rlcomm import CommContext

    time.sleep(delays[rank])
    ctx = CommContext()
    ctx.init_distributed_env(world_size + 1, rank, backend="gloo", timeout=timeout_s)


def test_ranks_that_arrive_after_the_store_host_gave_up_still_learn_who_is_missing() -> None:
    # As on a cluster, ranks start seconds apart. Rank 0 serves the store and times out first;
    # ranks 1 and 2 arrived 3 s later, so they time out 3 s later, when rank 0 has given up. They
    # must still name the missing rank (forked ranks: the timing is exact, unlike app start-up).
    timeout_s = 5
    errors = run_ranks(_join_late, 3, [0.0, 3.0, 3.0], timeout_s, expect_failure=True, timeout=90)
    assert sorted(errors) == [0, 1, 2], errors
    for rank, error in errors.items():
        first = error.splitlines()[0]
        assert first == (f"JoinTimeoutError: rank {rank}: ranks [3] never joined within "
                         f"{timeout_s}s; arrived: [0,1,2] of 4"), error
