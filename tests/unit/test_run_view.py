"""The run as a person sees it, in this process: the terminal emulator the e2e tests read with
(tests/helpers/screen.py), the stop rule's progress, the plain line off a terminal, and an
elastic run's live rollout ranks. Whole runs on a real pseudo-terminal and on a pipe are
tests/e2e/test_run_view.py."""

from __future__ import annotations

import io
import math
import time

import pytest

from app.output.progress import RunProgress, Snapshot, StopRule
from tests.helpers.screen import Screen

pytestmark = pytest.mark.unit


def test_screen_emulator_overwrites_as_a_terminal_does() -> None:
    screen = Screen(10).feed("abc\r\nbar 10%\rbar 50%\r\x1b[Kmsg\r\nbar 90%\x1b[A\rX\n\r\n0123456789AB")
    assert screen.lines() == ["abc", "Xsg", "bar 90%", "0123456789", "AB"]


def test_stop_rule_progress_is_the_current_fraction_of_what_ends_the_run() -> None:
    rule = StopRule(target_return=200.0, window=20, total_env_steps=1000)
    assert rule.fraction(-math.inf, 0) == 0.0  # fewer than `window` episodes yet
    assert rule.fraction(50.0, 900) == 0.25  # the budget does not move a target bar
    assert rule.fraction(30.0, 950) == 0.15  # a falling return moves the bar back
    assert rule.fraction(-10.0, 0) == 0.0 and rule.fraction(200.0, 10) == 1.0
    budget = StopRule(target_return=None, window=20, total_env_steps=1000)
    assert budget.fraction(499.0, 250) == 0.25 and budget.fraction(0.0, 1000) == 1.0


def test_off_a_terminal_a_plain_line_is_printed_at_most_once_per_interval() -> None:
    stream = io.StringIO()  # not a terminal
    view = RunProgress(StopRule(None, 20, 4096), stream=stream, plain_interval_s=0.3)

    def update(steps: int) -> None:
        view.update(Snapshot(steps, -math.inf, 3, 1000.0, steps // 1024, steps / 1000))

    update(1024)  # the first update is shown at once
    update(2048)  # too soon: not shown
    time.sleep(0.35)
    update(3072)
    update(4096)  # too soon, but the last state: shown by close()
    view.close()
    lines = stream.getvalue().splitlines()
    assert [line.split(" env steps")[0] for line in lines] == [
        f"[rank0] ppo: {steps} of 4,096" for steps in ("1,024", "3,072", "4,096")
    ], lines
    assert lines[-1].startswith("[rank0] ppo: 4,096 of 4,096 env steps 100% | mean return -- "
                                "(3/20 episodes), 1,000 steps/s, weights v4, 0:04")
    assert "\r" not in stream.getvalue()


def test_an_elastic_run_shows_its_live_rollout_ranks_and_when_it_waits_for_them() -> None:
    stream = io.StringIO()
    view = RunProgress(StopRule(475.0, 20, 4096), stream=stream, plain_interval_s=0.0)
    view.update(Snapshot(1024, -math.inf, 3, 1000.0, 1, 1.0, members=3))
    view.waiting("waiting up to 300 s for rollout ranks to join: 0 live of "
                 "loop.min_rollouts=1; lost: rank 2 on node2 (connection closed)")
    view.update(Snapshot(2048, -math.inf, 5, 1000.0, 2, 2.0, members=2))
    view.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("1,000 steps/s, 3 rollout ranks, weights v1, 0:01"), lines
    assert lines[1] == ("[rank0] ppo: waiting up to 300 s for rollout ranks to join: 0 live "
                        "of loop.min_rollouts=1; lost: rank 2 on node2 (connection closed)")
    assert lines[2].endswith("1,000 steps/s, 2 rollout ranks, weights v2, 0:02"), lines
