"""Sequence (context) parallel trainers through ``python -m app`` (docs/sharding.md): a
transformer trained sp2 x dp2 on a colocated layout, its sharded checkpoint resumed on DDP; and
sp2 x fsdp trainers feeding rollout ranks the whole model's exact weights through the sharded
hand-off."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from app.runtime.checkpoints.policy import load_policy_state
from tests.helpers.apprun import metrics, run_ppo

pytestmark = pytest.mark.e2e

# A small transformer on the memory task, its window of 4 split in 2 chunks of 2.
SMALL = ("+experiment=memory", "loop.model.width=16", "loop.model.heads=2", "loop.model.layers=1",
         "loop.model.context=4", "loop.hparams.num_envs=4", "loop.hparams.num_steps=32",
         "loop.checkpoint_every=1", "loop.target_return=10000", "comm.timeout=120")
# 4 colocated trainers: SEQUENCE_PARALLEL [0,1] and [2,3], DATA_PARALLEL [0,2] and [1,3].
SP2_DDP2 = ("layout=tp2dp2", "layout.tensor_parallel_size=1", "layout.sequence_parallel_size=2")
DDP4 = ("layout=tp2dp2", "layout.tensor_parallel_size=1", "layout.data_parallel_size=4")


def _reports(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r["result"] for r in result["ranks"]}


@pytest.mark.timeout(600)
def test_an_sp2_x_dp2_run_trains_and_its_checkpoint_resumes_on_ddp(tmp_path: Path) -> None:
    run_dir = tmp_path / "sp2"
    result = run_ppo(run_dir, *SMALL, *SP2_DDP2, "loop.total_env_steps=1024")
    reports = _reports(result)
    assert sorted(reports) == [0, 1, 2, 3]
    for report in reports.values():
        assert report["updates"] == 2 and report["env_steps"] == 1024, report
        assert report["hand_off"] == "flat"
        assert report["param_checksum"] == reports[0]["param_checksum"]  # one model
    rows = metrics(run_dir)
    assert [row["update"] for row in rows] == [1.0, 2.0]
    assert all(math.isfinite(row[name]) for row in rows for name in ("pg_loss", "v_loss"))
    assert all(row["entropy"] > 0 for row in rows)
    # A DCP checkpoint (the trained copy's parameters are DTensors, replicated over data x
    # sequence here, so DCP writes each once), whose whole policy reads back on one process.
    checkpoint = run_dir / "checkpoints" / "ckpt_000002"
    assert (checkpoint / ".metadata").exists() and (checkpoint / "state.pt").exists()
    policy = load_policy_state(checkpoint)
    assert float(sum(t.double().sum() for t in policy.values())) == reports[0]["param_checksum"]

    resumed = tmp_path / "ddp4"
    run_ppo(resumed, *SMALL, *DDP4, "loop.total_env_steps=2048", f"loop.resume={run_dir}")
    assert [row["update"] for row in metrics(resumed)] == [3.0, 4.0]
    assert re.search(r"resumed from \S+/ckpt_000002 at update 2",
                     (resumed / "logs" / "rank0.log").read_text())


@pytest.mark.timeout(600)
def test_rollout_ranks_fed_by_sp2_fsdp_trainers_act_with_the_whole_models_exact_weights(
    tmp_path: Path,
) -> None:
    # Trainers 0 and 1 split the window; rollout ranks 2 and 3 receive the whole weights.
    run_dir = tmp_path / "split"
    result = run_ppo(run_dir, *SMALL, "layout.world_size=4", "layout.trainers=2",
                     "layout.sequence_parallel_size=2", "layout.elastic_rollouts=false",
                     "loop.data_parallel=fsdp", "loop.verify_weights_every=1",
                     "loop.total_env_steps=512")
    reports = _reports(result)
    assert {report["hand_off"] for report in reports.values()} == {"sharded"}
    version = reports[0]["weights_version"]
    whole = load_policy_state(run_dir / "checkpoints" / f"ckpt_{version - 1:06d}")
    checksum = float(sum(t.double().sum() for t in whole.values()))
    for rank in (2, 3):
        assert reports[rank]["weights_version"] == version, reports[rank]
        assert reports[rank]["param_checksum"] == checksum, rank
