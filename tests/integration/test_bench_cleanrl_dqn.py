"""``python -m benchmarks.cleanrl_dqn``'s CleanRL side as a real child process: a stand-in for
CleanRL's ``dqn.py`` in a checkout laid out as CleanRL's gets the env, seed and flags, finds
``cleanrl_utils``, and is terminated as soon as the mean of its last 20 printed returns reaches
475 (it would train on), with the time of that line; one that never gets there is terminated
after ``--max-seconds`` and says so (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest

from benchmarks import cleanrl_dqn

pytestmark = pytest.mark.integration

STAND_IN = '''
import sys, time
import cleanrl_utils  # CleanRL's scripts import it from the checkout's root
argv = sys.argv[1:]
assert argv[argv.index("--env-id") + 1] == "CartPole-v1", argv
assert argv[argv.index("--seed") + 1] == "5", argv
assert {"--no-cuda", "--no-track", "--no-capture-video"} <= set(argv), argv
for episode in range(1, 1000):
    value = 500 if episode > 10 else 20  # the mean of the last 20 reaches 475 at episode 29
    print(f"global_step={episode * 100}, episodic_return=[{value if REACHES else 20}.]")
    print("SPS: 1000")
    if episode == 25:
        time.sleep(0.5)
    time.sleep(0.01)
time.sleep(60)  # not reached when terminated at the target
'''


def _args(tmp_path: Path, reaches: bool, max_seconds: float) -> argparse.Namespace:
    (tmp_path / "checkout" / "cleanrl_utils").mkdir(parents=True)
    (tmp_path / "checkout" / "cleanrl_utils" / "__init__.py").write_text("")
    script = tmp_path / "checkout" / "cleanrl" / "dqn.py"
    script.parent.mkdir()
    script.write_text(STAND_IN.replace("REACHES", str(reaches)))
    return cleanrl_dqn.parse_args(["--cleanrl-script", str(script), "--cleanrl-python",
                                   sys.executable, "--seeds", "5",
                                   "--max-seconds", str(max_seconds)])


def test_cleanrl_is_terminated_once_the_mean_of_20_returns_reaches_475(tmp_path: Path) -> None:
    args = _args(tmp_path, reaches=True, max_seconds=60)
    started = time.monotonic()
    side = cleanrl_dqn.run_cleanrl(args, 5, tmp_path / "out")
    assert time.monotonic() - started < 30  # not its budget, nor the 60 s
    assert side.problem == "" and side.stopped.startswith("terminated at the target")
    # 20 returns of 500 from episode 11: (10 * 20 + 10 * 500) / 20 < 475 at episode 20,
    # (20 + 19 * 500) / 20 = 476 at episode 29.
    assert side.target_steps == 2900 and len(side.episodes) == 29
    assert side.target_s == pytest.approx(side.episodes[-1][1], abs=0.01)
    # Stamped as printed: the pause after episode 25 shows before episode 26's line.
    assert side.episodes[25][1] - side.episodes[24][1] >= 0.4
    assert side.target_s <= side.wall_s < side.target_s + 10


def test_cleanrl_that_does_not_reach_the_target_ends_after_max_seconds(tmp_path: Path) -> None:
    args = _args(tmp_path, reaches=False, max_seconds=3)
    side = cleanrl_dqn.run_cleanrl(args, 5, tmp_path / "out")
    assert side.target_s is None and side.target_steps is None
    assert "within 3 s (--max-seconds): 20.0 at " in side.problem and side.stopped == ""
    assert side.wall_s is not None and 3 <= side.wall_s < 10
