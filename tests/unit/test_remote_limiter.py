"""A trainer's view of the replay ranks' rate limiter (app/runtime/replay/client.py's
``totals_limiter``): counted over the replay ranks' totals, the learner steps that admit the
collectors' next inserts (what ``collector_wait_s`` times) are the steps each replay rank's own
limiter asks for, with several replay ranks and several trainers."""

from __future__ import annotations

import itertools

import pytest

from app.runtime.replay.buffer import RateLimiter, ReplaySettings
from app.runtime.replay.client import totals_limiter
from app.runtime.replay.routing import batch_shares

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("replays", "trainers"), [(1, 1), (2, 1), (2, 2), (3, 2)])
def test_the_steps_that_admit_inserts_are_each_replay_ranks(replays: int, trainers: int) -> None:
    settings = ReplaySettings(batch_size=48, min_size=96, samples_per_insert=8.0, tolerance=64.0)
    share = batch_shares(settings.batch_size, replays)[0]
    # Each replay rank's limiter, as ReplayServer builds it: a step is every trainer's share.
    # Its share of min_size, which is the whole run's.
    server = RateLimiter(settings.samples_per_insert, settings.tolerance,
                         settings.shard_min_size(replays), trainers * share)
    # The rule a trainer's RemoteReplay counts with: the replay ranks' totals.
    limiter = totals_limiter(settings, replays, trainers)
    assert settings.batch_size % replays == 0  # even shares: every rank counts alike
    compared = 0
    for inserts, samples, count in itertools.product(range(settings.shard_min_size(replays), 800, 37), range(0, 6000, 251),
                                                     (16, 64)):
        # The collectors' inserts spread evenly over the replay ranks, the batches too.
        want = server.steps_to_admit(inserts, samples, count, 1_000)
        got = limiter.steps_to_admit(replays * inserts, replays * samples, replays * count,
                                     1_000)
        assert got == want, (inserts, samples, count)
        compared += want > 0
    assert compared > 10  # the grid holds blocked collectors, not only free ones
