"""How many learner steps the collectors' next inserts wait for (RateLimiter.steps_to_admit),
against a hand computation; the e2e proof of both waits: tests/e2e/test_rate_limiter.py."""

from __future__ import annotations

import pytest

from app.runtime.replay.buffer import RateLimiter

pytestmark = pytest.mark.unit


def test_the_next_inserts_wait_for_the_steps_that_bring_samples_within_tolerance() -> None:
    limiter = RateLimiter(samples_per_insert=4.0, tolerance=8.0, min_size=0, batch_size=4)
    # 10 inserted, nothing sampled: target 40. Two more inserts need samples + 8 - 40 >= 2 * 4,
    # i.e. 40 samples: 10 steps of 4.
    assert limiter.steps_to_admit(10, 0, 2, most=100) == 10
    assert limiter.inserts_allowed(10, 39) < 2 <= limiter.inserts_allowed(10, 40)
    assert limiter.steps_to_admit(10, 0, 2, most=3) == 3  # capped at the steps taken
    # A learner ahead of the ratio holds nobody back.
    assert limiter.steps_to_admit(10, 48, 2, most=100) == 0
    slow = RateLimiter(samples_per_insert=0.25, tolerance=32.0, min_size=256, batch_size=32)
    assert slow.steps_to_admit(512, 64, 32, most=100) == 0
