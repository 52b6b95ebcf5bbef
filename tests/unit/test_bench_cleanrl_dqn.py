"""What ``python -m benchmarks.cleanrl_dqn`` reads and prints (docs/benchmarks.md, "DQN against
CleanRL's"): CleanRL's ``dqn.py`` output lines, the first moment the mean of its last 20 returns
reaches 475, our time to the target counted from launch, the ratio and the table, and its
command lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import cleanrl_dqn, cleanrl_side
from benchmarks.cleanrl_dqn import TargetSide

pytestmark = pytest.mark.unit


def test_cleanrls_lines_are_read_with_their_step_time_and_return() -> None:
    # As dqn.py prints them under gymnasium 0.29 (a one-element array), among its other lines.
    lines = [(0.2, "/venv/tyro/_parsers.py:365: UserWarning: The field `wandb-entity` ...\n"),
             (1.0, "global_step=28, episodic_return=[29.]\n"),
             (1.1, "SPS: 10867\n"),
             (1.5, "global_step=1038, episodic_return=[-14.5]\n"),
             (2.0, "global_step=52000, episodic_return=5e+02\n"),
             (2.5, "global_step=, episodic_return=[9.]\n"),  # no step: not an episode
             (3.0, "eval/episodic_return 12\n")]
    assert cleanrl_side.parse_episodes(lines) == [(28.0, 1.0, 29.0), (1038.0, 1.5, -14.5),
                                                  (52000.0, 2.0, 500.0)]
    assert cleanrl_side.parse_episode(4.0, "global_step=7, episodic_return=[1e+]\n") is None


def _episodes(*returns: float) -> list[tuple[float, float, float]]:
    """Episodes of the given returns, the i-th at env step 100 * (i + 1) and i + 1 seconds."""
    return [(100.0 * (i + 1), float(i + 1), r) for i, r in enumerate(returns)]


def test_the_target_is_first_reached_by_a_full_window_of_returns() -> None:
    # Three perfect episodes first: their mean is 500, but the window is not full yet.
    episodes = _episodes(500, 500, 500, *[10] * 5, *[480] * 4, 470, 475)
    window = 4
    # The window ending at episode 12 (480 x 4), and none before: the mean of the last 4 at
    # episode 11 is (10 + 480 * 3) / 4, at episode 4 (500 * 3 + 10) / 4; not a later one.
    assert cleanrl_dqn.first_reach(episodes, 475, window) == (1200.0, 12.0, 480.0)
    # Reaching exactly the target counts (>=), just under it does not.
    assert cleanrl_dqn.first_reach(_episodes(470, 480, 470, 480), 475, 4) == (400.0, 4.0, 475.0)
    assert cleanrl_dqn.first_reach(_episodes(470, 480, 470, 479), 475, 4) is None
    assert cleanrl_dqn.first_reach(_episodes(500, 500, 500), 475, 4) is None  # never a full one
    assert cleanrl_dqn.first_reach([], 475, 20) is None


def test_the_streaming_check_looks_at_the_last_full_window_only() -> None:
    assert not cleanrl_dqn.reached(_episodes(*[500] * 19))  # 19 of the 20
    assert cleanrl_dqn.reached(_episodes(*[500] * 19, 0))  # 9,500 / 20: 475 exactly
    assert not cleanrl_dqn.reached(_episodes(*[500] * 18, 0, 0))
    assert cleanrl_dqn.reached(_episodes(0, *[475] * 20))  # the old 0 is out of the window
    assert not cleanrl_dqn.reached(_episodes(*[475] * 19, 474))


def test_our_time_to_the_target_counts_from_launch(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("update,env_steps,wall_s,return_window\n1,256,0.75,nan\n2,512,1.5,20\n")
    # The first update came 6.0 s after launch, when the loop's clock read 0.75 s.
    start = cleanrl_side.loop_start_s(cleanrl_side.metrics_rows(metrics), 6.0)
    assert start == pytest.approx(5.25)
    summary = {"time_to_target_s": 20.5, "env_steps_to_target": 41_216}
    assert cleanrl_dqn.our_target(summary, start) == (25.75, 20.5, 41_216)
    assert cleanrl_dqn.our_target(summary, None) == (None, 20.5, 41_216)
    assert cleanrl_dqn.our_target({"time_to_target_s": None, "env_steps_to_target": None},
                                  start) == (None, None, None)
    assert cleanrl_side.loop_start_s([], 6.0) is None
    assert cleanrl_side.metrics_rows(tmp_path / "none.csv") == []


def _pair(seed: int, cleanrl_s: float | None, ours_s: float | None,
          problem: str = "") -> tuple[TargetSide, TargetSide]:
    cleanrl = TargetSide("CleanRL", seed, wall_s=(cleanrl_s or 300.0) + 0.4, load=(0.5, 1.25),
                         target_s=cleanrl_s, target_steps=52_000 if cleanrl_s else None,
                         stopped="terminated at the target" if cleanrl_s else "",
                         problem="" if cleanrl_s else "did not reach 475")
    ours = TargetSide("ours", seed, wall_s=30.0, load=(1.25, 2.0), target_s=ours_s,
                      loop_target_s=ours_s - 5.0 if ours_s else None,
                      target_steps=40_960 if ours_s else None, problem=problem)
    return cleanrl, ours


def test_the_table_gives_ours_over_cleanrls_time_to_the_target() -> None:
    lines = cleanrl_dqn.table([_pair(1, 80.0, 20.0), _pair(2, None, 25.0),
                               _pair(3, 60.0, None, problem="exit code 1: boom")])
    assert lines[0].startswith("| seed | side | time to 475, from launch | env steps to 475 |")
    assert len(lines) == 2 + 6
    cleanrl, ours = lines[2].split(" | "), lines[3].split(" | ")
    assert cleanrl[2:6] == ["80.0 s", "52,000", "80.4 s", ""]
    assert ours[2:6] == ["20.0 s (15.0 s in training)", "40,960", "30.0 s", "0.25"]  # not 4.00
    assert "terminated at the target" in lines[2] and "0.50 / 1.25" in lines[2]
    assert "1.25 / 2.00" in lines[3]
    # A side without a time to the target: no ratio, and why.
    assert lines[4].split(" | ")[2] == "-" and "did not reach 475" in lines[4]
    assert lines[5].split(" | ")[5] == "-"
    assert lines[7].split(" | ")[2] == "-" and lines[7].split(" | ")[5] == "-"
    assert "exit code 1: boom" in lines[7]


def test_the_command_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cleanrl_dqn.parse_args(["--cleanrl-script", str(tmp_path / "missing.py")])
    assert exit_.value.code == 2 and "missing.py is not a file" in capsys.readouterr().err
    script = tmp_path / "dqn.py"
    script.write_text("")
    with pytest.raises(SystemExit):
        cleanrl_dqn.parse_args(["--cleanrl-script", str(script), "--seeds", "1,x"])
    assert "--seeds" in capsys.readouterr().err
    args = cleanrl_dqn.parse_args(["--cleanrl-script", str(script)])
    assert (args.seeds, args.max_seconds, args.layout) == ([1, 2, 3], 300.0, None)
    # The user's layout; no progress line (CleanRL's dqn.py prints none), our checkpoints on.
    assert cleanrl_dqn.our_overrides(args, 2) == [
        "loop=dqn", "seed=2", "loop.progress=false"]
    args = cleanrl_dqn.parse_args(["--cleanrl-script", str(script), "--seeds", "4",
                                   "--layout", "single", "--max-seconds", "60"])
    assert (args.seeds, args.max_seconds) == ([4], 60.0)
    assert cleanrl_dqn.our_overrides(args, 4)[-1] == "layout=single"
    options = cleanrl_dqn.cleanrl_options(4)
    assert options[:4] == ["--env-id", "CartPole-v1", "--seed", "4"]
    assert {"--no-cuda", "--no-track", "--no-capture-video"} <= set(options)
    assert "--total-timesteps" not in options  # CleanRL's own budget: 500,000
