"""Elastic trainers under the local launcher, on real processes (docs/failures.md): a trainer
SIGKILLed mid-run is dropped by the others, which make the update it broke again and take its
rollout ranks, nobody restarted; with ``launcher.trainer_restarts`` a new process for it joins
at an update boundary and heals from the lead (equal checksums, logged); a SIGSTOPped trainer is
dropped as timed out and, continued, is told it left; an off-policy trainer's replay shard is
lost with it, counted; a trainer started again by hand (RANK/WORLD_SIZE, as torchrun or srun
start one) joins the running job and heals. Nothing is left running.

The trainers' group recovery itself (collectives that run again on the next group, an update
redone) is in tests/integration/test_trainer_group.py.
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers.apprun import (
    AppProcess,
    collapse,
    column,
    end_all,
    read_result,
    rows_so_far,
    start_by_hand,
)

pytestmark = pytest.mark.e2e

# The default layout (2t2r) and PPO on CartPole: seed 0 solves in about 100k env steps.
SOLVES = ("loop.progress=false", "loop.total_env_steps=1000000", "comm.timeout=60")
KILL_AFTER_UPDATES = 8


def signal_rank_after(app: AppProcess, rank: int, updates: int, signum: int) -> psutil.Process:
    """Sends ``signum`` to the rank's process (not its slot) once metrics.csv has ``updates``
    rows; the process."""
    app.wait_until(f"{updates} updates", lambda: len(rows_so_far(app.run_dir)) >= updates)
    process = app.ranks()[rank]
    assert process.name() == f"rlcomm-rank{rank}", process.name()
    process.send_signal(signum)
    return process


def report(result: dict[str, Any], rank: int) -> dict[str, Any]:
    found: dict[str, Any] = next(r for r in result["ranks"] if r["rank"] == rank)["result"]
    return found


def pids(app: AppProcess) -> dict[int, int]:
    return {rank: process.pid for rank, process in app.ranks().items()}


def test_a_killed_trainer_is_dropped_and_the_others_go_on_without_a_restart(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("trainer-killed", *SOLVES)
    killed = signal_rank_after(app, 1, KILL_AFTER_UPDATES, signal.SIGKILL)
    before = pids(app)
    at_kill = len(rows_so_far(app.run_dir))
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    assert result["summary"]["solved"], app.describe()
    assert result["summary"]["restarts"] == 0
    # Ranks 0, 2 and 3 kept their processes.
    assert not killed.is_running() or killed.status() == psutil.STATUS_ZOMBIE
    assert {r: p for r, p in before.items() if r != 1} == \
        {r["rank"]: r["pid"] for r in result["ranks"]}, app.describe()
    updates = column(app.run_dir, "update")
    assert updates == list(range(1, len(updates) + 1)), updates  # no update twice
    trainers = column(app.run_dir, "trainers")
    assert trainers[:KILL_AFTER_UPDATES] == [2] * KILL_AFTER_UPDATES and trainers[-1] == 1
    (leave,) = result["trainer_leaves"]
    assert (leave["rank"], leave["reason"]) == (1, "killed"), leave
    assert leave["next_update_s"] is not None and leave["next_update_s"] < 30, leave
    assert result["trainer_joins"] == []
    # Rank 3, trainer 1's rollout rank, went to rank 0 and kept sending segments (one per
    # update before the kill).
    assert report(result, 3)["segments_sent"] > at_kill + 2, report(result, 3)
    assert [c["rank"] for c in result["joins"]] == [3], result["joins"]
    assert re.search(r"rank 1 \(trainer\) left: connection closed; 1 trainer goes on, "
                     r"serving rollout ranks 2, 3", app.log(0)), app.log(0)[-3000:]
    assert "trainers: 1 left, 0 joined" in app.stdout, app.describe()
    assert len(updates) > at_kill
    app.assert_all_ended()



def test_a_restarted_trainer_heals_from_the_lead_and_trains_with_the_others(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("trainer-healed", *SOLVES, "launcher.trainer_restarts=1")
    signal_rank_after(app, 1, KILL_AFTER_UPDATES, signal.SIGKILL)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    assert result["summary"]["restarts"] == 0
    updates = column(app.run_dir, "update")
    assert updates == list(range(1, len(updates) + 1)), updates
    assert collapse(column(app.run_dir, "trainers")) == [2, 1, 2], column(app.run_dir, "trainers")
    (leave,) = result["trainer_leaves"]
    (join,) = result["trainer_joins"]
    assert (leave["rank"], join["rank"], join["reason"]) == (1, 1, "joined"), (leave, join)
    assert join["time"] > leave["time"] and join["epoch"] > leave["epoch"]
    healed = re.search(r"rank 1 \(trainer\) healed from rank 0 at update (\d+): \d+ bytes, "
                       r"checksum [0-9a-f]{16} equal on the trainers \[0, 1\]", app.log(0))
    assert healed, app.log(0)[-3000:]
    assert int(healed.group(1)) >= KILL_AFTER_UPDATES
    # The healed trainer trained on with the lead: the same weights and counts at the end.
    lead, rejoined = report(result, 0), report(result, 1)
    assert rejoined["param_checksum"] == lead["param_checksum"]
    assert (rejoined["updates"], rejoined["env_steps"]) == (lead["updates"], lead["env_steps"])
    assert rejoined["trainers"] == [0, 1]
    assert "joins the running job" in app.log(1)
    assert re.search(r"^\[launcher\] rank 1 \(pid \d+\) was killed by SIGKILL; starting it "
                     r"again \(restart 1 of 1\)$", app.stderr, re.MULTILINE), app.describe()
    assert "trainers: 1 left, 1 joined" in app.stdout, app.describe()
    app.assert_all_ended()


def test_a_stopped_trainer_is_dropped_as_timed_out_and_told_it_left_once_continued(
    start_app: Callable[..., AppProcess],
) -> None:
    """SIGSTOP: the lead's call waits out the trainers' group timeout (half the patience, 0.4 x
    the hang timeout: 4 s at comm.timeout=20), then drops it once its heartbeat stood still;
    SIGCONT: its next call over the trainers' group tells it it left, and it ends (no restarts)
    without touching the survivors, whose rollout ranks waited through it."""
    app = start_app("trainer-stopped", "loop.progress=false", "loop.total_env_steps=150000",
                    "loop.target_return=1e9", "comm.timeout=20")
    stopped = signal_rank_after(app, 1, KILL_AFTER_UPDATES, signal.SIGSTOP)
    try:
        app.wait_until("the lead drops rank 1", lambda: "rank 1 (trainer) left" in app.log(0))
    finally:
        stopped.send_signal(signal.SIGCONT)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    (leave,) = result["trainer_leaves"]
    assert (leave["rank"], leave["reason"]) == (1, "timed out"), leave
    assert "rank 1 (trainer) left: timed out; 1 trainer goes on" in app.log(0)
    assert "left the trainers: the lead, rank 0, formed epoch 1 without it" in app.log(1)
    assert re.search(r"^\[launcher\] rank 1 \(pid \d+\) exited with code 1 \(PeerLostError: .*"
                     r"left the trainers.*\); not restarted \(launcher\.trainer_restarts=0\)$",
                     app.stderr, re.MULTILINE), app.describe()
    updates = column(app.run_dir, "update")
    assert updates == list(range(1, len(updates) + 1)), updates
    assert column(app.run_dir, "env_steps")[-1] >= 150000  # the budget, on the survivors
    assert [r["rank"] for r in result["ranks"]] == [0, 2, 3]
    app.assert_all_ended()


def test_an_off_policy_trainer_is_lost_with_its_replay_shard_counted(
    start_app: Callable[..., AppProcess],
) -> None:
    """DQN on 2t2r: each trainer holds its own replay shard; the survivor trains on (its own
    shard, and from then on both rollout ranks' transitions) and the lost shard is counted."""
    app = start_app("dqn-trainer-killed", "loop=dqn", "layout=2t2r", "seed=1",
                    "loop.progress=false", "loop.checkpoint_every=0", "loop.target_return=1e9",
                    "loop.total_env_steps=40960", "comm.timeout=60")
    signal_rank_after(app, 1, KILL_AFTER_UPDATES, signal.SIGKILL)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    (leave,) = result["trainer_leaves"]
    assert (leave["rank"], leave["reason"]) == (1, "killed"), leave
    assert leave["lost_transitions"] > 0, leave
    assert result["summary"]["trainers"]["transitions_lost"] == leave["lost_transitions"]
    assert f"{leave['lost_transitions']:,} replay transitions lost with them" in app.stdout
    written = rows_so_far(app.run_dir)
    last = written[-1]
    assert int(float(last["trainers"])) == 1 and int(float(last["env_steps"])) >= 40960
    # The survivor's shard went on filling, from both rollout ranks.
    assert float(last["replay_inserts"]) > float(written[KILL_AFTER_UPDATES]["replay_inserts"])
    app.assert_all_ended()


def test_a_trainer_started_again_by_hand_joins_the_running_job_and_heals(
    tmp_path: Path,
) -> None:
    """Ranks started one by one (RANK/WORLD_SIZE, as torchrun or srun starts each): trainer 1
    is killed, and one more process for it, started by hand, joins the running job and heals
    from the lead."""
    marker = uuid.uuid4().hex
    # 120 updates: room for a new process (imports, rendezvous, healing) on a loaded machine.
    run_dir, start = start_by_hand(tmp_path, marker, "loop.total_env_steps=245760",
                                   "comm.timeout=60", layout="2t2r", world_size=4)
    procs = [start(rank, f"rank{rank}") for rank in range(4)]
    try:
        deadline = time.monotonic() + 120
        while len(rows_so_far(run_dir)) < KILL_AFTER_UPDATES:
            assert time.monotonic() < deadline and procs[0].poll() is None, \
                (tmp_path / "rank0.out").read_text()
            time.sleep(0.05)
        procs[1].kill()
        lead_log = run_dir / "logs" / "rank0.log"
        while "rank 1 (trainer) left" not in lead_log.read_text():
            assert time.monotonic() < deadline + 60, lead_log.read_text()[-3000:]
            time.sleep(0.05)
        procs.append(start(1, "rank1-again"))
        codes = [proc.wait(timeout=180) for proc in procs]
    finally:
        end_all(procs, marker)
    assert codes == [0, -signal.SIGKILL, 0, 0, 0], [
        (p.name, p.read_text()[-3000:]) for p in sorted(tmp_path.glob("*.out"))]
    result = read_result(run_dir)
    (join,) = result["trainer_joins"]
    assert join["rank"] == 1, join
    assert re.search(r"rank 1 \(trainer\) healed from rank 0 at update \d+: \d+ bytes, checksum "
                     r"[0-9a-f]{16} equal on the trainers \[0, 1\]", lead_log.read_text())
    assert collapse(column(run_dir, "trainers")) == [2, 1, 2], column(run_dir, "trainers")
    assert report(result, 1)["param_checksum"] == report(result, 0)["param_checksum"]
