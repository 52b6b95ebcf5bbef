"""Sharded trainers through ``python -m app`` (docs/sharding.md): a transformer policy trained
tensor-parallel x FSDP, its rollout ranks acting with the whole model's exact weights (also after
one of them was killed and rejoined), and checkpoints that resume on another trainer grid."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.runtime.checkpoints import load_checkpoint
from tests.helpers.apprun import AppProcess, describe, metrics, read_result, run_app, run_ppo

pytestmark = pytest.mark.e2e

# A small transformer on the memory task: 4 collectors x 128 env steps per update on tp2dp2.
SMALL = ("+experiment=memory", "loop.model.width=16", "loop.model.heads=2", "loop.model.layers=1",
         "loop.model.context=4", "loop.hparams.num_envs=4", "loop.hparams.num_steps=32",
         "loop.checkpoint_every=1", "loop.target_return=10000", "comm.timeout=120")
TP2_FSDP2 = ("layout=tp2dp2", "loop.data_parallel=fsdp")
# 4 trainers in a 2 x 2 grid, each feeding one rollout rank.
TP2_FSDP2_SPLIT = ("layout.world_size=8", "layout.trainers=4", "layout.tensor_parallel_size=2",
                   "loop.data_parallel=fsdp")
LOSSES = ("pg_loss", "v_loss", "entropy")


def _reports(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r["result"] for r in result["ranks"]}


def _losses(run_dir: Path) -> list[list[float]]:
    return [[row[name] for name in LOSSES] for row in metrics(run_dir)]


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    # Relative to at least 0.01 (the policy loss crosses zero); see tests/test_sharding.py.
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 * max(abs(x), 1e-2)
                                    for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.fixture(scope="module")
def tp2_fsdp2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two updates of the transformer on tp2dp2 under FSDP2, a checkpoint after each."""
    run_dir = tmp_path_factory.mktemp("sharded") / "first"
    run_ppo(run_dir, *SMALL, *TP2_FSDP2, "loop.total_env_steps=1024")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "ckpt_000001.pt", "ckpt_000002.pt"]
    return run_dir


def test_a_tp2_x_fsdp2_checkpoint_resumes_on_other_grids(tp2_fsdp2_run: Path,
                                                         tmp_path: Path) -> None:
    resumed = {}
    for name, grid in {"tp2-fsdp2": TP2_FSDP2, "tp2-ddp2": ("layout=tp2dp2",)}.items():
        run_dir = tmp_path / name
        run_ppo(run_dir, *SMALL, *grid, "loop.total_env_steps=2048", f"loop.resume={tp2_fsdp2_run}")
        assert re.search(r"resumed from \S+/ckpt_000002\.pt at update 2",
                         (run_dir / "logs" / "rank0.log").read_text())
        assert [row["update"] for row in metrics(run_dir)] == [3.0, 4.0]
        resumed[name] = _losses(run_dir)
    # The same data per replica, so the same losses from the resumed update on.
    assert _close(resumed["tp2-fsdp2"], resumed["tp2-ddp2"]), resumed
    # DDP over two trainers (2t2r) takes it too, and its own checkpoint (optimizer state by
    # parameter index) goes back to the tp2 x fsdp2 grid.
    ddp_dir = tmp_path / "ddp2"
    result = run_ppo(ddp_dir, *SMALL, "layout=2t2r", "loop.total_env_steps=1536",
                     f"loop.resume={tp2_fsdp2_run}")
    assert _reports(result)[0]["updates"] == 4 and result["status"] == "ok"
    back = tmp_path / "back"
    result = run_ppo(back, *SMALL, *TP2_FSDP2, "loop.total_env_steps=2048",
                     f"loop.resume={ddp_dir}")
    assert [row["update"] for row in metrics(back)] == [5.0]
    assert re.search(r"resumed from \S+/ckpt_000004\.pt at update 4",
                     (back / "logs" / "rank0.log").read_text())


@pytest.mark.parametrize("hand_off", ["sharded", "elastic"])
def test_rollout_ranks_fed_by_tp2_x_fsdp2_trainers_act_with_the_whole_models_exact_weights(
    tmp_path: Path, hand_off: str,
) -> None:
    run_dir = tmp_path / "split"
    static = ("layout.elastic_rollouts=false",) if hand_off == "sharded" else ()
    result = run_ppo(run_dir, *SMALL, *TP2_FSDP2_SPLIT, *static, "loop.total_env_steps=3072",
                     "loop.verify_weights_every=1")
    reports = _reports(result)
    assert [reports[r]["role"] for r in range(8)] == ["trainer"] * 4 + ["rollout"] * 4
    assert {reports[r]["hand_off"] for r in range(8)} == {hand_off}
    version = reports[0]["weights_version"]
    # Every version was checked against the trainer's bytes on arrival (verify_weights_every=1).
    # The last one, sent after update version - 1, is what the checkpoint of that update holds:
    # the whole model, bit for bit (sharded: assembled by each rollout rank from four owners).
    state = load_checkpoint(run_dir / "checkpoints" / f"ckpt_{version - 1:06d}.pt")
    whole = float(sum(t.double().sum() for t in state["policy"].values()))
    for rank in range(4, 8):
        assert reports[rank]["weights_version"] == version, reports[rank]
        assert reports[rank]["param_checksum"] == whole, rank
    if hand_off == "sharded":
        # Each element left one trainer: together they sent the whole weights once per
        # version to each of the 4 rollout ranks, and none sent more than half of them.
        whole_bytes = sum(t.nbytes for t in [*state["policy"].values(),
                                              *state["normalizers"].values()])
        sent = [reports[r]["weight_bytes_sent"] for r in range(4)]
        assert sum(sent) == version * 4 * whole_bytes, (sent, whole_bytes)
        assert max(sent) < version * 4 * whole_bytes / 2, sent


def test_a_killed_rollout_rank_of_a_sharded_grid_rejoins_with_verified_weights(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("rejoined", *SMALL, *TP2_FSDP2_SPLIT, "loop.total_env_steps=30000",
                    "loop.verify_weights_every=1", "launcher.rollout_restarts=1",
                    "loop.checkpoint_every=0", "loop.progress=false")
    app.wait_until("3 updates", lambda: len(_rows(app.run_dir)) >= 3)
    process = app.ranks()[7]
    assert process.name() == "rlcomm-rank7", process.name()
    process.kill()
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    (join,) = result["joins"]
    assert join["rank"] == 7 and join["reason"] == "admitted"
    reports = _reports(result)
    assert reports[7]["joined"] is True
    for rank in (4, 5, 6):  # the same version, so the same whole weights as every rollout's
        assert reports[7]["weights_version"] == reports[rank]["weights_version"]
        assert reports[7]["param_checksum"] == reports[rank]["param_checksum"]
    assert "joins the running job" in app.log(7)
    app.assert_all_ended()


def _rows(run_dir: Path) -> list[dict[str, float]]:
    return metrics(run_dir) if (run_dir / "metrics.csv").exists() else []


def test_a_bad_grid_is_one_line_and_exit_2_before_any_rank_starts(tmp_path: Path) -> None:
    proc = run_app("loop.progress=false", f"hydra.run.dir={tmp_path}", "layout=tp2dp2")
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines() == [
        "error: layout.tensor_parallel_size: 2, but ActorCritic (loop.model.kind=mlp) has no "
        "tensor-parallel plan; use loop.model.kind=transformer or a module with "
        "tensor_parallel_plan()"], describe(proc)
    assert not (tmp_path / "logs").exists()
