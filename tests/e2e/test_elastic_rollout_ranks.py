"""Elastic rollout ranks under the local launcher, on real processes: a rollout rank killed
mid-run is dropped and the run goes on; with ``launcher.rollout_restarts`` it comes back and is
admitted with the current weights; a surviving rollout rank feeds every trainer; below
``loop.min_rollouts`` (the job's live rollout ranks) the trainers wait for a joiner if one can
come (ranks started by hand), else the run ends at once, naming who was lost; a resumed run
starts a new membership epoch. Nothing is left running.

Multi-host cases (a whole rollout host killed and restarted, a link down) are in
tests/cluster/test_multinode.py; the groups themselves in
tests/integration/test_elastic_groups.py.
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.apprun import AppProcess, end_all, read_result, rows_so_far, start_by_hand

pytestmark = pytest.mark.e2e

# CartPole on 1t3r with seed 1 reaches 475 in about 200k env steps with three rollout ranks.
SOLVES = ("layout=1t3r", "seed=1", "loop.progress=false", "loop.total_env_steps=1500000",
          "comm.timeout=60")
KILL_AFTER_UPDATES = 10


def members_by_update(run_dir: Path) -> list[int]:
    return [int(float(row["members"])) for row in rows_so_far(run_dir)]


def kill_rank_after(app: AppProcess, rank: int, updates: int) -> float:
    """SIGKILLs the rank's process (not its slot) once metrics.csv has ``updates`` rows."""
    app.wait_until(f"{updates} updates", lambda: len(rows_so_far(app.run_dir)) >= updates)
    process = app.ranks()[rank]
    assert process.name() == f"rlcomm-rank{rank}", process.name()
    process.send_signal(signal.SIGKILL)
    return time.time()


def collapse(values: list[int]) -> list[int]:
    """Runs of equal values as one: [3, 3, 2, 2, 3] -> [3, 2, 3]."""
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


def trainer(result: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = next(r for r in result["ranks"] if r["rank"] == 0)["result"]
    return report


def test_a_killed_rollout_rank_is_dropped_and_the_run_solves_with_the_others(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("dropped", *SOLVES)
    killed = kill_rank_after(app, 3, KILL_AFTER_UPDATES)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    assert result["summary"]["solved"], app.describe()
    members = members_by_update(app.run_dir)
    assert collapse(members) == [3, 2], members  # 3 -> 2 collectors, and no way back
    assert members.index(2) >= KILL_AFTER_UPDATES
    (leave,) = result["leaves"]
    assert (leave["rank"], leave["reason"]) == (3, "connection closed"), leave
    assert leave["time"] - killed < 30 and leave["next_update_s"] is not None
    assert result["joins"] == []
    assert trainer(result)["segments_discarded"] >= 1  # what it had in flight, counted
    # The trainer kept its process and state: one uninterrupted count of updates.
    updates = [int(float(row["update"])) for row in rows_so_far(app.run_dir)]
    assert updates == list(range(1, len(updates) + 1))
    assert "resumed from" not in app.log(0)
    assert re.search(r"^\[launcher\] rank 3 \(pid \d+\) was killed by SIGKILL; not restarted "
                     r"\(launcher\.rollout_restarts=0\)$", app.stderr, re.MULTILINE), app.describe()
    assert "rollout ranks: 1 left, 0 joined" in app.stdout, app.describe()
    assert sorted(r["rank"] for r in result["ranks"]) == [0, 1, 2]  # rank 3 never reported
    app.assert_all_ended()


def test_a_restarted_rollout_rank_rejoins_with_the_current_weights(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("rejoined", *SOLVES, "launcher.rollout_restarts=1")
    kill_rank_after(app, 3, KILL_AFTER_UPDATES)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    # Whether PPO then solves within the budget is chance (the segments' order depends on
    # timing): the weights the rejoined rank acts with are checked below, by version and lag.
    members = members_by_update(app.run_dir)
    assert collapse(members) in ([3, 2, 3], [3]), members  # 2 only if it took an update
    epochs = [int(float(row["epoch"])) for row in rows_so_far(app.run_dir)]
    assert epochs == sorted(epochs) and epochs[0] == 0 and epochs[-1] >= 1, epochs
    (join,) = result["joins"]
    assert join["rank"] == 3 and join["reason"] == "admitted"
    # Its first segment was collected with the weights the trainer was about to train.
    assert join["first_segment_lag"] == 0 and join["first_trained_s"] is not None, join
    assert [leave["rank"] for leave in result["leaves"]] == [3]
    rejoined = next(r for r in result["ranks"] if r["rank"] == 3)["result"]
    assert rejoined["joined"] is True
    assert rejoined["weights_version"] == trainer(result)["weights_version"]
    assert rejoined["updates"] == trainer(result)["updates"]  # the job's count, as everyone's
    assert 0 < rejoined["segments_sent"] < trainer(result)["updates"]  # its own
    assert re.search(r"^\[launcher\] rank 3 \(pid \d+\) was killed by SIGKILL; starting it "
                     r"again \(restart 1 of 1\)$", app.stderr, re.MULTILINE), app.describe()
    assert "joins the running job" in app.log(3)
    app.assert_all_ended()


def test_a_rollout_rank_serves_the_job_when_another_trainers_rollout_rank_is_lost(
    start_app: Callable[..., AppProcess],
) -> None:
    """The default 2t2r without restarts: rank 3 (trainer 1's) is killed; rank 2 feeds both
    trainers from the next update on and the run ends at its budget, no one waiting."""
    app = start_app("served", "loop.target_return=1e9", "loop.progress=false",
                    "loop.total_env_steps=61440", "comm.timeout=60")
    kill_rank_after(app, 3, 5)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    assert [leave["rank"] for leave in result["leaves"]] == [3] and result["joins"] == []
    members = members_by_update(app.run_dir)
    assert collapse(members) == [2, 1], members  # the job's live rollout ranks per update
    assert "waiting up to" not in app.stderr, app.describe()
    reports = {r["rank"]: r["result"] for r in result["ranks"] if r["rank"] != 3}
    assert reports[0]["updates"] == reports[1]["updates"] == len(members)
    assert reports[0]["env_steps"] == 61440  # the budget, not a wait, ended it
    # Both trainers trained every update, on what rank 2 sent alone from the loss on (one
    # segment per update), and hold the same weights.
    assert reports[2]["segments_sent"] == len(members)
    assert reports[0]["param_checksum"] == reports[1]["param_checksum"]
    app.assert_all_ended()


def test_below_min_rollouts_with_no_joiner_possible_the_run_ends_at_once_naming_who_was_lost(
    start_app: Callable[..., AppProcess],
) -> None:
    # The patience would be 0.8 x the hang timeout (comm.timeout - min(comm.timeout / 2, 30)):
    # 48 s here. No restart is left (launcher.rollout_restarts=0) and the local launcher takes
    # no joiner by hand, so nothing can come: the run ends without waiting for it.
    app = start_app("lost", "layout=1t1r", "loop.target_return=1e9", "loop.progress=false",
                    f"loop.total_env_steps={10**9}", "comm.timeout=90")
    killed = kill_rank_after(app, 1, 5)
    assert app.wait() == 2, app.describe()
    took = time.time() - killed
    assert took < 48, took
    assert "waiting up to" not in app.stderr, app.describe()
    assert re.fullmatch(
        r"error: rank 0 exit code 1: MembersLostError: 0 live rollout ranks of "
        r"loop\.min_rollouts=1, and none can join \(launcher\.rollout_restarts=0\); lost: "
        r"rank 1 on \S+ \(connection closed\) \(log: \S+rank0\.log\)", app.last_line), \
        app.describe()
    app.assert_all_ended()


def test_below_min_rollouts_with_a_join_possible_the_trainer_waits_then_ends_naming_who_was_lost(
    tmp_path: Path,
) -> None:
    """Ranks started by hand (RANK/WORLD_SIZE): a replacement for a lost rollout rank may be
    started at any time, so the trainer waits the patience for one (0.8 x the hang timeout,
    comm.timeout - min(comm.timeout / 2, 30): 8 s here), then ends the run naming who was
    lost."""
    patience_s = 8
    marker = uuid.uuid4().hex
    run_dir, start = start_by_hand(tmp_path, marker, f"loop.total_env_steps={10**9}",
                                   "comm.timeout=20")
    outs = [tmp_path / f"rank{rank}.out" for rank in (0, 1)]
    procs = [start(0, "rank0"), start(1, "rank1")]
    try:
        deadline = time.monotonic() + 120
        while len(rows_so_far(run_dir)) < 5:
            assert time.monotonic() < deadline and procs[0].poll() is None, outs[0].read_text()
            time.sleep(0.05)
        procs[1].kill()
        killed = time.monotonic()
        assert procs[0].wait(timeout=patience_s + 90) != 0, outs[0].read_text()
        took = time.monotonic() - killed
    finally:
        end_all(procs, marker)
    text = outs[0].read_text()
    assert patience_s <= took < patience_s + 60, took
    assert (f"waiting up to {patience_s} s for rollout ranks to join: 0 live of "
            "loop.min_rollouts=1; lost: rank 1 on ") in text, text[-3000:]
    assert re.fullmatch(rf"error: 0 live rollout ranks of loop\.min_rollouts=1 for {patience_s} "
                        r"s; lost: rank 1 on \S+ \(connection closed\)",
                        text.strip().splitlines()[-1]), text[-3000:]


def test_a_checkpoint_records_the_epoch_and_a_resumed_run_starts_a_new_one(
    start_app: Callable[..., AppProcess],
) -> None:
    first = start_app("first", "layout=1t1r", "loop.target_return=1e9", "loop.progress=false",
                      "loop.total_env_steps=20480", "loop.checkpoint_every=5")
    assert first.wait() == 0, first.describe()
    assert {int(float(r["epoch"])) for r in rows_so_far(first.run_dir)} == {0}
    import torch

    (newest,) = sorted((first.run_dir / "checkpoints").glob("ckpt_*.pt"))[-1:]
    assert torch.load(newest, weights_only=False)["epoch"] == 0
    resumed = start_app("resumed", "layout=1t1r", "loop.target_return=1e9", "loop.progress=false",
                        "loop.total_env_steps=30720", f"loop.resume={first.run_dir}")
    assert resumed.wait() == 0, resumed.describe()
    epochs = {int(float(r["epoch"])) for r in rows_so_far(resumed.run_dir)}
    assert epochs == {1}, epochs
    resumed.assert_all_ended()


def test_a_rank_started_by_hand_joins_the_running_job_and_replaces_the_live_process(
    tmp_path: Path,
) -> None:
    """Ranks started one by one (the env join mode, as srun or a hand-made script would):
    a second process for rollout rank 1 finds the job running, is admitted, and the first one
    stops; the run finishes with the newcomer."""
    marker = uuid.uuid4().hex
    budget = 102400  # room for a new process (imports, rendezvous) to be admitted before the end
    run_dir, start = start_by_hand(tmp_path, marker, f"loop.total_env_steps={budget}",
                                   "comm.timeout=60")
    procs = [start(0, "rank0"), start(1, "rank1")]
    try:
        deadline = time.monotonic() + 120
        while len(rows_so_far(run_dir)) < 10:
            assert time.monotonic() < deadline and procs[0].poll() is None, \
                (tmp_path / "rank0.out").read_text()
            time.sleep(0.05)
        procs.append(start(1, "rank1-again"))
        for proc in procs:
            assert proc.wait(timeout=120) == 0, [
                (p.name, p.read_text()[-3000:]) for p in sorted(tmp_path.glob("*.out"))]
    finally:
        end_all(procs, marker)
    result = read_result(run_dir)
    (leave,) = result["leaves"]
    (join,) = result["joins"]
    assert (leave["rank"], leave["reason"]) == (1, "replaced by a new process"), leave
    assert join["rank"] == 1 and join["first_segment_lag"] == 0, join
    assert re.search(r"rank 1 \(pid \d+\): replaced by a newer process \(pid \d+\); stopping",
                     (tmp_path / "rank1.out").read_text())
    newcomer = next(r for r in result["ranks"] if r["rank"] == 1)["result"]
    assert newcomer["joined"] is True
    assert trainer(result)["env_steps"] == budget  # the whole budget, nothing redone
    assert [int(float(r["update"])) for r in rows_so_far(run_dir)] == list(
        range(1, trainer(result)["updates"] + 1))
