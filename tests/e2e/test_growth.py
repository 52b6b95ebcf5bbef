"""A job that shrinks when asked, on real processes: SIGTERM to one rollout rank (or
``python -m app.leave RUN_DIR rank=N``) makes it finish its segment and leave at its trainer's
next update boundary; the others go on, the leave is recorded with reason ``asked``, and no
restart is spent on it (docs/elastic.md, "Growing and shrinking")."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.apprun import AppProcess, read_result, rows_so_far

pytestmark = pytest.mark.e2e

# On the waiting CartPole (2 ms a step) an update of 1t3r takes about 2 s on 2 cores: the run
# lasts long enough to act on it while it goes (CartPole itself would be done in 2 s).
RUN = ("layout=1t3r", "loop.env.id=WaitingCartPole-v1", "loop.progress=false",
       "loop.target_return=1e9", "loop.total_env_steps=40960", "comm.timeout=60")


def members_by_update(run_dir: Path) -> list[int]:
    return [int(float(row["members"])) for row in rows_so_far(run_dir)]


def test_a_sigtermed_rollout_rank_leaves_asked_and_the_run_goes_on_without_a_restart(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("asked", *RUN, "launcher.rollout_restarts=1")
    app.wait_until("3 updates", lambda: len(rows_so_far(app.run_dir)) >= 3)
    process = app.ranks()[3]
    assert process.name() == "rlcomm-rank3", process.name()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)  # it leaves at the next boundary (its code: the slot's, below)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    (leave,) = result["leaves"]
    assert (leave["rank"], leave["reason"]) == (3, "asked"), leave
    assert result["joins"] == []
    members = members_by_update(app.run_dir)
    assert members[0] == 3 and members[-1] == 2, members
    assert "starting it again" not in app.stderr and "was killed" not in app.stderr, \
        app.describe()
    assert re.search(r"rank 3: asked to stop \(SIGTERM\); it leaves rank 0's group at its next "
                     r"update boundary", app.log(3)), app.log(3)[-3000:]
    assert "rank 0 let it go" in app.log(3)
    assert "rollout ranks: 1 left, 0 joined" in app.stdout, app.describe()
    app.assert_all_ended()


def side_command(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_app_leave_lets_one_rollout_rank_go_and_refuses_a_trainer_in_one_line(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("leave-cli", *RUN)
    app.wait_until("3 updates", lambda: len(rows_so_far(app.run_dir)) >= 3)
    trainer = side_command("app.leave", str(app.run_dir), "rank=0")
    assert trainer.returncode == 2, trainer
    assert trainer.stderr.strip() == ("error: rank=0: a trainer (trainers [0]); only rollout "
                                      "ranks leave when asked"), trainer.stderr
    asked = side_command("app.leave", str(app.run_dir), "rank=2")
    assert asked.returncode == 0, asked
    assert re.fullmatch(r"rank 2 left the job: its trainer let it go from epoch \d+\n",
                        asked.stdout), asked.stdout
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    (leave,) = result["leaves"]
    assert (leave["rank"], leave["reason"]) == (2, "asked"), leave
    assert "rank 0 let it go" in app.log(2)
    assert members_by_update(app.run_dir)[-1] == 2
    finished = side_command("app.leave", str(app.run_dir), "rank=1")
    assert finished.returncode == 2, finished
    assert finished.stderr.strip() == (f"error: {app.run_dir}: the run finished (result.json); "
                                       "nothing runs there"), finished.stderr
    app.assert_all_ended()


@pytest.mark.parametrize(("args", "line"), [
    ((), "error: usage: python -m app.leave RUN_DIR rank=N"),
    (("{missing}", "rank=1"), "error: {missing}: no such run dir"),
    (("{empty}", "rank=one"), "error: rank=one: a rank number (an integer >= 0)"),
    (("{empty}", "rank=1"), "error: {empty}: no running job there (job.json is written once a "
                            "job with elastic ranks runs)"),
])
def test_app_leave_refuses_bad_input_in_one_line(
    tmp_path: Path, args: tuple[str, ...], line: str,
) -> None:
    names = {"missing": str(tmp_path / "missing"), "empty": str(tmp_path)}
    done = side_command("app.leave", *(a.format(**names) for a in args), timeout=60)
    assert (done.returncode, done.stderr.strip()) == (2, line.format(**names)), done


def test_app_leave_names_a_job_whose_store_is_gone(tmp_path: Path) -> None:
    """A job.json left by a job that ended without result.json (killed): its store does not
    answer; one line, exit 2, within the job's timeout."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    (tmp_path / "job.json").write_text(json.dumps({
        "store": {"host": "127.0.0.1", "port": port, "prefix": "rlcomm/0/1/"},
        "world_size": 2, "trainers": [0], "rollouts": [1], "elastic_rollouts": True,
        "elastic_trainers": False, "timeout_s": 3.0, "pid": 1, "host": "gone"}))
    done = side_command("app.leave", str(tmp_path), "rank=1", timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.startswith(f"error: {tmp_path}: the job's store at 127.0.0.1:{port} did "
                                  "not answer within 3 s: the job has ended or this host cannot "
                                  "reach it ("), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
