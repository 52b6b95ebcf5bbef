"""The run as a person sees it, through ``python -m app``: the progress line, messages above it,
the closing summary, and TensorBoard scalars; on a real pseudo-terminal and on a pipe. The
pieces in this process are tests/unit/test_run_view.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.output.trackers.tensorboard import HINT
from tests.helpers.apprun import REPO, describe, run_app, run_app_in_terminal
from tests.helpers.screen import Screen

COLUMNS = 140


@pytest.mark.e2e
def test_a_run_on_a_terminal_shows_one_bar_messages_above_it_and_the_summary(
    tmp_path: Path,
) -> None:
    # The default layout and loop, with a target low enough to reach in a few updates.
    code, raw = run_app_in_terminal(
        "loop.target_return=100", "loop.checkpoint_every=2", f"hydra.run.dir={tmp_path}",
        columns=COLUMNS,
    )
    text = raw.decode(errors="replace")
    assert code == 0, text[-4000:]
    assert "\r" in text.replace("\r\n", "")  # the bar was redrawn in place
    lines = Screen(COLUMNS).feed(text).lines()
    shown = "\n".join(lines)
    bars = [i for i, line in enumerate(lines) if "ppo: mean return" in line]
    assert len(bars) == 1, shown
    bar = lines[bars[0]]
    assert re.search(r"of 100 100%\|\S+\| ", bar) and len(bar) <= COLUMNS, shown
    notices = [i for i, line in enumerate(lines) if "checkpoint ckpt_" in line]
    assert notices, shown
    for i in notices:  # each notice on its own line, printed above the bar
        assert re.fullmatch(r"\[rank0\] checkpoint ckpt_\d{6}\.pt \(update \d+, \d+ env steps\)",
                            lines[i]) and i < bars[0], shown

    summary = json.loads((tmp_path / "result.json").read_text())["summary"]
    assert summary["solved"] and summary["final_mean_return"] >= 100
    steps = f"{summary['env_steps_to_target']:,} env steps"
    assert steps in bar, shown
    block = lines[lines.index("---- run summary " + "-" * 55) :]
    assert bars[0] < lines.index(block[0]), shown
    assert block[1].startswith("solved: mean return of the last 20 episodes reached 100 after "), shown
    assert f"of training and {steps} (final {summary['final_mean_return']:.1f})" in block[1], shown
    assert f"{summary['env_steps_per_s']:,.0f} env steps/s" in block[2], shown
    assert "0 restarts, 4 ranks for " in block[2], shown
    for name in ("metrics.csv", "learning_curve.png", "checkpoints", "logs", "result.json"):
        assert f"{name}  " in shown and summary["files"][name] in shown, shown
        assert Path(summary["files"][name]).exists()
    assert "succeeded" not in shown  # the block replaced the old last line


WARNING_LOOP = """
import warnings


class Warns:
    def __call__(self, ctx, job):
        warnings.warn(f"careful on rank {job.rank}")
        return {"warned": job.rank}

    def summary(self, result, run_dir):  # a loop's own figures and files in the summary
        return {"warned": result["warned"], "files": {"notes": str(run_dir / "notes.txt")}}
"""


@pytest.mark.e2e
def test_every_ranks_warnings_reach_the_console_through_the_one_path(tmp_path: Path) -> None:
    (tmp_path / "warnloop.py").write_text(WARNING_LOOP)
    proc = run_app("layout=1t1r", "loop=custom", "loop._target_=warnloop.Warns",
                   f"hydra.run.dir={tmp_path / 'run'}", env={"PYTHONPATH": f"{REPO}:{tmp_path}"},
                   cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    for rank in (0, 1):  # a warning is a log record: on the console with its rank, and in its log
        pattern = rf"^\[rank{rank}\] \S+warnloop.py:\d+: UserWarning: careful on rank {rank}$"
        assert re.search(pattern, proc.stderr, re.MULTILINE), describe(proc)
        assert f"careful on rank {rank}" in (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
    summary = json.loads((tmp_path / "run" / "result.json").read_text())["summary"]
    assert summary["warned"] == 0 and summary["files"]["notes"] == str(tmp_path / "run" / "notes.txt")
    assert "\nnotes        run/notes.txt\n" in proc.stdout, describe(proc)  # relative to cwd


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One run on pipes (as in CI) that trains to its budget (the target only noted)."""
    run_dir = tmp_path_factory.mktemp("piped")
    proc = run_app(
        "layout=single", "loop.target_return=1e9", "loop.stop_at_target=false",
        "loop.total_env_steps=4096",
        "loop.hparams.num_envs=4", "loop.hparams.num_steps=64", "loop.checkpoint_every=0",
        "loop.tensorboard=true", f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, describe(proc)
    return run_dir, proc


@pytest.mark.e2e
def test_off_a_terminal_progress_is_plain_lines_against_the_budget(
    piped_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, proc = piped_run
    assert "\r" not in proc.stderr and "\x1b" not in proc.stderr, describe(proc)
    progress = [line for line in proc.stderr.splitlines() if "[rank0] ppo:" in line]
    assert progress, describe(proc)
    for line in progress:
        assert re.fullmatch(
            r"\[rank0\] ppo: [\d,]+ of 4,096 env steps +\d+% \| mean return (\S+ \(last 20\)|-- "
            r"\(\d+/20 episodes\)), [\d,]+ steps/s, weights v\d+, \d+:\d\d(, ~\d+:\d\d left)?",
            line,
        ), line
    assert progress[-1].startswith("[rank0] ppo: 4,096 of 4,096 env steps 100% | "), describe(proc)

    summary = json.loads((run_dir / "result.json").read_text())["summary"]
    assert not summary["solved"] and summary["env_steps"] == 4096 and summary["restarts"] == 0
    block = proc.stdout[proc.stdout.index("---- run summary") :].splitlines()
    mean = summary["final_mean_return"]
    assert block[1] == (
        f"not solved: mean return of the last 20 episodes is {mean:.1f}, target 1e+09; "
        "the budget of 4,096 env steps ended the run"
    ), describe(proc)
    assert block[2].startswith(f"{summary['env_steps_per_s']:,.0f} env steps/s, weight transfer "
                               "0.0% of trainer time, 0 restarts, 1 rank for "), describe(proc)
    assert block[-1] == "-" * 72


def _scalars(run_dir: Path) -> dict[str, list[Any]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


@pytest.mark.e2e
def test_tensorboard_scalars_are_written_under_the_run_dir(
    piped_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, _ = piped_run
    scalars = _scalars(run_dir)
    expected = {"mean_return", "mean_return_window", "pg_loss", "v_loss", "entropy",
                "env_steps_per_s", "transfer_s_total", "weights_version"}
    assert {f"ppo/{name}" for name in expected} <= set(scalars), sorted(scalars)
    # One point per update (16 updates of 256 env steps), stepped by env steps.
    assert [e.step for e in scalars["ppo/pg_loss"]] == [256 * u for u in range(1, 17)]
    with (run_dir / "metrics.csv").open() as handle:
        header = handle.readline().strip().split(",")
        last = dict(zip(header, handle.readlines()[-1].strip().split(",")))
    assert scalars["ppo/v_loss"][-1].value == pytest.approx(float(last["v_loss"]), rel=1e-6)
    summary = json.loads((run_dir / "result.json").read_text())["summary"]
    assert summary["files"]["tensorboard"] == str(run_dir / "tensorboard")


@pytest.mark.e2e
def test_tensorboard_without_the_package_fails_before_launch_with_a_hint(tmp_path: Path) -> None:
    # The app exactly as `python -m app`, in an interpreter where tensorboard cannot be imported.
    blocked = ("import sys, runpy; sys.modules['tensorboard'] = None; "
               "sys.argv[0] = 'app'; runpy.run_module('app', run_name='__main__')")
    proc = run_app("loop.tensorboard=true", f"hydra.run.dir={tmp_path}", timeout=120,
                   module=(sys.executable, "-c", blocked))
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines() == [f"error: {HINT}"], describe(proc)
    assert not (tmp_path / "logs").exists()  # no rank ever started
