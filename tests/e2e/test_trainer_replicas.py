"""Replica groups of sharded trainers (``layout.trainer_replicas``, docs/failures.md), through
``python -m app`` on real processes: four tensor-parallel x FSDP2 trainers in two replica groups
train as the one grid does (the same losses); a SIGKILLed rank takes its whole replica group out
while the other group goes on with every rollout rank, nobody restarted; with
``launcher.trainer_restarts`` the lost group's new processes form their grid again and heal from
the live group, equal checksums logged. Bad values are one line and exit 2 before any rank
starts. Nothing is left running."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers.apprun import (
    AppProcess,
    collapse,
    column,
    describe,
    metrics,
    read_result,
    rows_so_far,
    run_app,
)

pytestmark = pytest.mark.e2e

# A small transformer on the memory task: 4 trainers (tensor 2 x data 2) each feeding one
# rollout rank, 4 x 4 envs x 32 steps = 512 env steps per update.
SMALL = ("+experiment=memory", "loop.model.width=16", "loop.model.heads=2", "loop.model.layers=1",
         "loop.model.context=4", "loop.hparams.num_envs=4", "loop.hparams.num_steps=32",
         "loop.target_return=10000", "comm.timeout=120", "loop.checkpoint_every=0",
         "loop.progress=false", "layout.world_size=8", "layout.trainers=4",
         "layout.tensor_parallel_size=2", "loop.data_parallel=fsdp")
REPLICAS = ("layout.trainer_replicas=2",)
LOSSES = ("pg_loss", "v_loss", "entropy")
KILL_AFTER_UPDATES = 4


def _losses(run_dir: Path) -> list[list[float]]:
    return [[row[name] for name in LOSSES] for row in metrics(run_dir)]


def _reports(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r["result"] for r in result["ranks"]}


def test_two_replica_groups_train_as_the_one_grid_does(
    start_app: Callable[..., AppProcess],
) -> None:
    """The same batch, minibatches and seeds: gradients averaged across the replica groups by
    FSDP's all-reduce hook equal FSDP's own average over the data-parallel pairs, to rounding.
    The lead's replica group writes the sharded checkpoints; a resume reads them into both."""
    runs, dirs = {}, {}
    for name, extra in (("one-grid", ()), ("replicas", REPLICAS)):
        app = start_app(name, *SMALL, *extra, "loop.total_env_steps=3072",
                        "loop.checkpoint_every=3")
        assert app.wait() == 0, app.describe()
        runs[name], dirs[name] = _losses(app.run_dir), app.run_dir
        app.assert_all_ended()
    one, replicas = runs["one-grid"], runs["replicas"]
    assert len(one) == len(replicas) == 6, (one, replicas)
    # Relative to at least 0.01 (the policy loss crosses zero): summation order differs.
    assert all(abs(x - y) <= 1e-4 * max(abs(x), 1e-2)
               for ra, rb in zip(one, replicas) for x, y in zip(ra, rb)), (one, replicas)
    checkpoint = dirs["replicas"] / "checkpoints" / "ckpt_000003"
    # Ranks 0 and 1, the lead's replica group, wrote their shards; rank 0 the index and state.
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    resumed = start_app("resumed", *SMALL, *REPLICAS, "loop.total_env_steps=3072",
                        f"loop.resume={checkpoint}")
    assert resumed.wait() == 0, resumed.describe()
    assert "resumed from" in resumed.log(2) and "at update 3" in resumed.log(2), resumed.log(2)
    assert [row["update"] for row in metrics(resumed.run_dir)][-1] == 6
    resumed.assert_all_ended()


def test_under_ddp_two_replica_groups_train_as_the_one_grid_does(
    start_app: Callable[..., AppProcess],
) -> None:
    """``loop.data_parallel=ddp`` with tensor parallelism: torch's ``replicate`` inside each
    replica group (here of one data replica each), the average across them by the same hook."""
    runs = {}
    for name, extra in (("one-grid", ()), ("replicas", REPLICAS)):
        app = start_app(name, *SMALL, "loop.data_parallel=ddp", *extra,
                        "loop.total_env_steps=2048")
        assert app.wait() == 0, app.describe()
        runs[name] = _losses(app.run_dir)
        app.assert_all_ended()
    one, replicas = runs["one-grid"], runs["replicas"]
    assert len(one) == len(replicas) == 4, (one, replicas)
    assert all(abs(x - y) <= 1e-4 * max(abs(x), 1e-2)
               for ra, rb in zip(one, replicas) for x, y in zip(ra, rb)), (one, replicas)


def test_a_killed_rank_takes_its_replica_group_out_and_the_other_goes_on(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("replica-lost", *SMALL, *REPLICAS, "loop.total_env_steps=20480")
    app.wait_until(f"{KILL_AFTER_UPDATES} updates",
                   lambda: len(rows_so_far(app.run_dir)) >= KILL_AFTER_UPDATES)
    before = {rank: process.pid for rank, process in app.ranks().items()}
    killed = app.ranks()[2]
    assert killed.name() == "rlcomm-rank2", killed.name()
    at_kill = len(rows_so_far(app.run_dir))
    killed.send_signal(signal.SIGKILL)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    assert result["summary"]["restarts"] == 0
    assert not killed.is_running() or killed.status() == psutil.STATUS_ZOMBIE
    reports = _reports(result)
    assert {reports[r]["hand_off"] for r in reports} == {"elastic"}  # whole weights
    # The other replica group (ranks 0, 1) and every rollout rank kept their processes.
    assert {r: before[r] for r in (0, 1, 4, 5, 6, 7)} == \
        {r["rank"]: r["pid"] for r in result["ranks"]}, app.describe()
    reasons = {leave["rank"]: leave["reason"] for leave in result["trainer_leaves"]}
    # Rank 3 either ended on its lost tensor-parallel peer or answered and was left out.
    assert reasons.keys() == {2, 3} and reasons[2] == "killed", reasons
    assert reasons[3] in ("killed", "with its replica group"), reasons
    assert result["trainer_joins"] == []
    updates = column(app.run_dir, "update")
    assert updates == list(range(1, len(updates) + 1)), updates  # no update twice
    trainers = column(app.run_dir, "trainers")
    assert trainers[:at_kill] == [4] * at_kill and trainers[-1] == 2, trainers
    assert result["summary"]["env_steps"] >= 20480, result["summary"]  # the budget reached
    # Ranks 6 and 7, the lost group's rollout ranks, went to ranks 0 and 1 and kept sending.
    for rank in (6, 7):
        assert reports[rank]["segments_sent"] > at_kill + 2, reports[rank]
    assert sorted(c["rank"] for c in result["joins"]) == [6, 7], result["joins"]
    # The group that went on holds one set of weights: the same whole weights on both ranks.
    assert reports[0]["param_checksum"] == reports[1]["param_checksum"]
    assert re.search(r"rank 2 \(trainer\) left: connection closed; 2 trainers go on, serving "
                     r"rollout ranks 4, 5, 6, 7", app.log(0)), app.log(0)[-3000:]
    assert "trainers: 2 left, 0 joined" in app.stdout, app.describe()
    app.assert_all_ended()


def test_with_restarts_the_lost_replica_group_is_rebuilt_and_heals_from_a_live_one(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("replica-rebuilt", *SMALL, *REPLICAS, "loop.total_env_steps=30720",
                    "launcher.trainer_restarts=1")
    app.wait_until(f"{KILL_AFTER_UPDATES} updates",
                   lambda: len(rows_so_far(app.run_dir)) >= KILL_AFTER_UPDATES)
    killed = app.ranks()[2]
    assert killed.name() == "rlcomm-rank2", killed.name()
    killed.send_signal(signal.SIGKILL)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    assert result["summary"]["restarts"] == 0
    updates = column(app.run_dir, "update")
    assert updates == list(range(1, len(updates) + 1)), updates
    assert collapse(column(app.run_dir, "trainers")) == [4, 2, 4], column(app.run_dir, "trainers")
    assert {c["rank"] for c in result["trainer_leaves"]} == {2, 3}
    assert [(c["rank"], c["reason"]) for c in result["trainer_joins"]] == \
        [(2, "joined"), (3, "joined")], result["trainer_joins"]
    # Both new processes formed their replica group's grid, then healed from the lead's group.
    for rank in (2, 3):
        assert re.search(r"rank \d \(trainer\) rebuilds its replica group \[2, 3\] \(rebuild 1\)",
                         app.log(rank)), app.log(rank)[-3000:]
    healed = re.search(r"ranks 2, 3 \(trainer\) healed from rank 0 at update (\d+): \d+ bytes, "
                       r"checksum [0-9a-f]{16} equal on the trainers \[0, 1, 2, 3\]", app.log(0))
    assert healed and int(healed.group(1)) >= KILL_AFTER_UPDATES, app.log(0)[-3000:]
    # They trained on with the other group: the same weights and counts at the end.
    reports = _reports(result)
    for rank in (1, 2, 3):
        assert reports[rank]["param_checksum"] == reports[0]["param_checksum"], reports
        assert reports[rank]["updates"] == reports[0]["updates"]
        assert reports[rank]["trainers"] == [0, 1, 2, 3]
    assert "trainers: 2 left, 2 joined" in app.stdout, app.describe()
    app.assert_all_ended()


def test_app_join_role_replica_brings_a_whole_replica_group_that_heals_from_a_live_one(
    start_app: Callable[..., AppProcess], tmp_path: Path,
) -> None:
    """``python -m app.join RUN_DIR role=replica``, one command: ranks 8 and 9, a third replica
    group beyond the plan, start together, form their grid, are admitted whole and heal from
    the lead's group (equal checksums logged); each rank of it ends with the weights of the
    rank at its place in the lead's group, and every process exits 0."""
    # Run until stopped: the group's two processes start, import and form their grid at the
    # pace of a loaded machine, which a run to a budget could outlast.
    app = start_app("replica-grown", *SMALL, *REPLICAS, f"loop.total_env_steps={10**9}")
    app.wait_until("3 updates", lambda: len(rows_so_far(app.run_dir)) >= 3)
    out = tmp_path / "joiner.out"
    with out.open("w") as sink:
        joiner = subprocess.Popen([sys.executable, "-m", "app.join", str(app.run_dir),
                                   "role=replica"], stdout=sink, stderr=subprocess.STDOUT)
    try:
        app.wait_until("6 trainers for 2 updates",
                       lambda: column(app.run_dir, "trainers")[-2:] == [6, 6])
        app.proc.send_signal(signal.SIGTERM)  # a stop at an update, with result.json
        assert app.wait() == 128 + signal.SIGTERM, app.describe()
        assert joiner.wait(timeout=120) == 0, out.read_text()[-3000:]
    finally:
        if joiner.poll() is None:
            joiner.kill()
            joiner.wait()
    assert collapse(column(app.run_dir, "trainers")) == [4, 6], column(app.run_dir, "trainers")
    result = read_result(app.run_dir)
    assert result["summary"]["stopped_by"] == "SIGTERM", result["summary"]
    assert [(j["rank"], j["reason"]) for j in result["trainer_joins"]] == \
        [(8, "beyond the plan"), (9, "beyond the plan")], result["trainer_joins"]
    assert re.search(r"ranks 8, 9 \(trainer\) healed from rank 0 at update \d+: \d+ bytes, "
                     r"checksum [0-9a-f]{16} equal on the trainers \[0, 1, 2, 3, 8, 9\]",
                     app.log(0)), app.log(0)[-3000:]
    reports = _reports(result)
    assert (reports[8]["param_checksum"], reports[9]["param_checksum"]) == \
        (reports[0]["param_checksum"], reports[1]["param_checksum"])
    assert "ranks [8, 9] (a replica group, beyond the plan of 8) ask rank 0 to admit them" in \
        out.read_text()
    assert result["summary"]["trainers"] == {"left": 0, "joined": 2, "transitions_lost": 0,
                                             "grew_to": 10}, result["summary"]
    app.assert_all_ended()

@pytest.mark.parametrize(("overrides", "line"), [
    (("layout.trainer_replicas=3",),
     "error: layout.trainer_replicas: 3 does not divide the 4 trainers [0,1,2,3]"),
    (("layout.trainer_replicas=2", "layout.elastic_trainers=false"),
     "error: layout.trainer_replicas: 2 makes replica groups that survive a loss, but trainers "
     "are static here (layout.elastic_trainers=false)"),
])
def test_a_bad_replica_setting_is_one_line_and_exit_2_before_any_rank_starts(
    tmp_path: Path, overrides: tuple[str, ...], line: str,
) -> None:
    proc = run_app(*SMALL, *overrides, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines() == [line], describe(proc)
    assert not (tmp_path / "logs").exists()
