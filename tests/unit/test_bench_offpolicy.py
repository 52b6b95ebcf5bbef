"""What ``python -m benchmarks.offpolicy`` and ``python -m benchmarks.cleanrl_sac`` read from a
run and print (docs/benchmarks.md, "Off-policy throughput and CleanRL's SAC"): the learning
phase's rates from ``metrics.csv``, the time split per role from ``result.json``, the table,
CleanRL's episodic returns from its output and from real TensorBoard events, and the checks of
their command lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import cleanrl_sac, offpolicy

pytestmark = pytest.mark.unit


def _row(steps: float, wall: float, learner_steps: float) -> dict[str, float]:
    return {"env_steps": steps, "wall_s": wall, "learner_steps": learner_steps}


def test_learning_rates_leave_out_the_warm_up_before_the_first_learner_step() -> None:
    rows = [_row(100, 1.0, 0), _row(200, 1.5, 0), _row(300, 3.5, 50), _row(400, 5.5, 100)]
    env_rate, learner_rate = offpolicy.learning_rates(rows) or (0.0, 0.0)
    # From the update before the first learner step (200 steps at 1.5 s) to the last one.
    assert env_rate == pytest.approx(200 / 4.0)
    assert learner_rate == pytest.approx(150 / 4.0)
    assert offpolicy.learning_rates([_row(100, 1.0, 0), _row(200, 2.0, 0)]) is None


def _rank(role: str, wait_fraction: float, **parts: float) -> dict[str, Any]:
    return {"result": {"role": role, "wait_fraction": wait_fraction,
                       "time_split_s": {"env": 0.0, "act": 0.0, "collect_other": 0.0,
                                        "update": 0.0, "comm": 0.0, "other": 0.0, **parts}}}


def test_the_split_is_per_role_with_waiting_and_replay_taken_apart() -> None:
    result = {"ranks": [
        _rank("trainer", 0.1, update=8.0, comm=1.5, other=0.5, loop=10.0),
        _rank("rollout", 0.6, env=1.0, act=1.0, collect_other=0.0, comm=8.0, loop=10.0),
        _rank("rollout", 0.4, env=2.0, act=2.0, collect_other=0.0, comm=6.0, loop=10.0),
    ]}
    # metrics.csv's replay_s over the run: 2 of the trainer's 8 s of update.
    rows = [{"replay_s": 0.5}, {"replay_s": float("nan")}, {"replay_s": 1.5}]
    in_replay = offpolicy.replay_fraction(result, rows)
    assert in_replay == pytest.approx(0.25)
    split = offpolicy.split_shares(result, in_replay)
    assert split["trainer"] == pytest.approx({"collect": 0.0, "replay": 0.2, "learn": 0.6,
                                              "comm": 0.05, "waiting": 0.1, "other": 0.05})
    # The rollout ranks' median: collecting 0.2 and 0.4, communication 0.8 and 0.6 of which
    # they waited 0.6 and 0.4.
    assert split["rollout"]["collect"] == pytest.approx(0.3)
    assert split["rollout"]["waiting"] == pytest.approx(0.5)
    assert split["rollout"]["comm"] == pytest.approx(0.2)
    for shares in split.values():
        assert sum(shares.values()) == pytest.approx(1.0)


def test_the_table_has_a_line_per_role_and_says_why_a_run_failed() -> None:
    ok = offpolicy.Measured("sac", "1t2r", 2, learning_env_steps_per_s=150.0,
                            learner_steps_per_s=149.0, env_steps_per_s=180.0,
                            samples_per_insert=256.0, learner_wait_updates=3,
                            load=(1.0, 1.5))
    ok.split = {"trainer": dict.fromkeys(offpolicy.SPLIT_NAMES, 0.2),
                "rollout": dict.fromkeys(offpolicy.SPLIT_NAMES, 0.2)}
    failed = offpolicy.Measured("dqn", "single", 1, problem="exit code 1: boom")
    lines = offpolicy.table([ok, failed])
    widths = {line.count("|") for line in lines}
    assert len(widths) == 1  # every line has every column
    assert "| sac | 1t2r | 2 | 150 | 149 | 180 | 256.00 | 3 | trainer | 20% | 20% |" in lines[2]
    assert lines[3].startswith("| | |") and "| rollout |" in lines[3]
    assert "failed: exit code 1: boom" in lines[4]


def test_offpolicys_command_line_names_what_it_does_not_know(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = offpolicy.parse_args(["--quick", "--only", "dqn", "--layouts", "single,1t2r"])
    assert (args.quick, args.only, args.layouts) == (True, ["dqn"], ["single", "1t2r"])
    with pytest.raises(SystemExit) as exit_:
        offpolicy.parse_args(["--layouts", "3t9r"])
    assert exit_.value.code == 2 and "3t9r" in capsys.readouterr().err


def test_cleanrls_printed_returns_are_parsed_with_when_they_were_read() -> None:
    lines = [(0.5, "SPS: 41\n"), (1.0, "global_step=615, episodic_return=[10.215792]\n"),
             (2.0, "global_step=630, episodic_return=[-14.5]\n"),
             (2.5, "global_step=640, episodic_return=3.25e+02\n")]
    episodes = cleanrl_sac.parse_episodes(lines)
    assert episodes == [(615.0, 1.0, 10.215792), (630.0, 2.0, -14.5), (640.0, 2.5, 325.0)]
    assert cleanrl_sac.mean_last(episodes, 2) == pytest.approx((-14.5 + 325.0) / 2)
    assert cleanrl_sac.mean_last([], 20) is None


def test_cleanrls_returns_come_from_its_tensorboard_events(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "runs" / "Hopper-v4__sac__1"))
    for step, value in ((20, 12.0), (45, 30.5), (90, 8.0)):
        writer.add_scalar("charts/episodic_return", value, step)
    writer.add_scalar("losses/alpha", 0.5, 90)  # not a return
    writer.close()
    episodes = cleanrl_sac.tensorboard_episodes(tmp_path / "runs")
    assert [(step, value) for step, _, value in episodes] == [(20, 12.0), (45, 30.5),
                                                              (90, 8.0)]
    assert cleanrl_sac.tensorboard_episodes(tmp_path / "nothing") == []


def test_cleanrl_sacs_command_line_checks_the_script_and_maps_the_env(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cleanrl_sac.parse_args(["--cleanrl-script", str(tmp_path / "missing.py")])
    assert exit_.value.code == 2 and "missing.py is not a file" in capsys.readouterr().err
    script = tmp_path / "sac_continuous_action.py"
    script.write_text("")
    args = cleanrl_sac.parse_args(["--cleanrl-script", str(script), "--experiment",
                                   "halfcheetah_sac", "--seeds", "1,2"])
    assert (args.env_id, args.seeds, args.steps) == ("HalfCheetah-v4", [1, 2], 300_000)
    assert not any(o.startswith("loop.threads=") for o in cleanrl_sac.our_overrides(args, 1))
    args = cleanrl_sac.parse_args(["--cleanrl-script", str(script), "--layout", "single",
                                   "--threads", "2", "--steps", "5000"])
    assert {"layout=single", "loop.threads=2", "loop.total_env_steps=5000", "seed=3"} <= set(
        cleanrl_sac.our_overrides(args, 3))


def test_our_curve_is_the_window_mean_counted_from_launch(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("update,env_steps,wall_s,mean_return,return_window\n"
                    "1,32,0.5,nan,nan\n"  # no episode yet
                    "2,64,1.0,30.0,20.0\n"  # this update's episodes: 30; the window's: 20
                    "3,96,1.5,nan,20.0\n")  # none ended in this update: the window holds
    # The first update came 4.5 s after launch, when the loop's clock read 0.5 s.
    assert cleanrl_sac.curve_from_metrics(path, 4.5) == [(64.0, 5.0, 20.0), (96.0, 5.5, 20.0)]
    assert cleanrl_sac.curve_from_metrics(path)[0] == (64.0, 1.0, 20.0)
