"""Sharded trainers through ``python -m app`` (docs/sharding.md): a transformer policy trained
tensor-parallel x FSDP, its rollout ranks acting with the whole model's exact weights (also after
one of them was killed and rejoined), and checkpoints written shard by shard that resume on
another trainer grid (DDP too) and skip a corrupt shard."""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from app.runtime.checkpoints.policy import load_policy_state
from tests.helpers.apprun import AppProcess, describe, metrics, read_result, run_app, run_ppo

pytestmark = pytest.mark.e2e

# A small transformer on the memory task: 4 collectors x 128 env steps per update on tp2dp2.
SMALL = ("+experiment=memory", "loop.model.width=16", "loop.model.heads=2", "loop.model.layers=1",
         "loop.model.context=4", "loop.hparams.num_envs=4", "loop.hparams.num_steps=32",
         "loop.checkpoint_every=1", "loop.target_return=10000", "comm.timeout=120")
TP2_FSDP2 = ("layout=tp2dp2", "loop.data_parallel=fsdp")
TP2_DDP2 = ("layout=tp2dp2",)
# 4 trainers in a 2 x 2 grid, each feeding one rollout rank.
TP2_FSDP2_SPLIT = ("layout.world_size=8", "layout.trainers=4", "layout.tensor_parallel_size=2",
                   "loop.data_parallel=fsdp")
LOSSES = ("pg_loss", "v_loss", "entropy")


def _reports(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r["result"] for r in result["ranks"]}


def _losses(run_dir: Path) -> list[list[float]]:
    return [[row[name] for name in LOSSES] for row in metrics(run_dir)]


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    # Relative to at least 0.01 (the policy loss crosses zero); see tests/integration/test_sharding.py.
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 * max(abs(x), 1e-2)
                                    for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.fixture(scope="module")
def tp2_fsdp2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two updates of the transformer on tp2dp2 under FSDP2, a sharded checkpoint after each,
    the first update's weights evaluated beside training (2 episodes)."""
    run_dir = tmp_path_factory.mktemp("sharded") / "first"
    run_ppo(run_dir, *SMALL, *TP2_FSDP2, "loop.total_env_steps=1024", "loop.eval_every=1",
            "loop.eval_episodes=2")
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["ckpt_000001", "ckpt_000002"]
    # Each of the four trainers wrote its own shard file; rank 0 DCP's index and state.pt.
    assert sorted(p.name for p in (checkpoints / "ckpt_000002").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "state.pt"]
    assert "ckpt_000002 (update 2, 1024 env steps, 4 trainers' shards)" in (
        run_dir / "logs" / "rank0.log").read_text()
    return run_dir


def test_a_sharded_run_evaluates_beside_training_and_its_checkpoint_evaluates_and_exports(
    tp2_fsdp2_run: Path,
) -> None:
    summary = read_result(tp2_fsdp2_run)["summary"]
    assert summary["eval"] is not None and summary["eval"]["version"] >= 1, summary
    assert summary["best_checkpoint"] is None  # sharded optimizer state: no checkpoints/best
    export = tp2_fsdp2_run / "policy.pt2"
    proc = run_app(str(tp2_fsdp2_run), "--episodes", "2", "--export", str(export),
                   module=(sys.executable, "-m", "app.evaluate"))
    assert proc.returncode == 0, describe(proc)
    assert "checkpoints/ckpt_000002: return" in proc.stdout, describe(proc)
    # A history policy's program takes windows: [B, context, obs_dim + 1] (the validity flag).
    windows = torch.zeros(3, 4, 3)
    windows[:, -1, -1] = 1.0
    actions = torch.export.load(str(export)).module()(windows)
    assert actions.shape == (3,) and set(actions.tolist()) <= {0, 1}


def _resumed(run_dir: Path, name: str, update: int) -> list[list[float]]:
    """The losses of a run resumed from ``name`` at ``update``, which rank 0's log names."""
    assert re.search(rf"resumed from \S+/{name} at update {update}",
                     (run_dir / "logs" / "rank0.log").read_text())
    return _losses(run_dir)


@pytest.mark.timeout(1200)  # 6 runs: about 3 minutes on 2 loaded cores
def test_a_tp2_x_fsdp2_checkpoint_resumes_on_other_grids(tp2_fsdp2_run: Path,
                                                         tmp_path: Path) -> None:
    resumed = {}
    for name, grid in {"tp2-fsdp2": TP2_FSDP2, "tp2-ddp2": TP2_DDP2}.items():
        run_dir = tmp_path / name
        run_ppo(run_dir, *SMALL, *grid, "loop.total_env_steps=2048", f"loop.resume={tp2_fsdp2_run}")
        assert [row["update"] for row in metrics(run_dir)] == [3.0, 4.0]
        resumed[name] = _resumed(run_dir, "ckpt_000002", 2)
    # The same data per replica, so the same losses from the resumed update on.
    assert _close(resumed["tp2-fsdp2"], resumed["tp2-ddp2"]), resumed
    # DDP over two trainers (2t2r) reads the shards into whole tensors, FSDP over the same two
    # reshards them: the same data per replica, the same losses.
    for name, grid in {"ddp2": (), "fsdp2": ("loop.data_parallel=fsdp",)}.items():
        run_dir = tmp_path / name
        result = run_ppo(run_dir, *SMALL, "layout=2t2r", *grid, "loop.total_env_steps=1536",
                         f"loop.resume={tp2_fsdp2_run}")
        assert _reports(result)[0]["updates"] == 4 and result["status"] == "ok"
        resumed[name] = _resumed(run_dir, "ckpt_000002", 2)
    assert _close(resumed["ddp2"], resumed["fsdp2"]), resumed
    # DDP's own checkpoint is one file (optimizer state by parameter index); it goes back to
    # the tp2 x fsdp2 grid and to tp2 x ddp2, alike.
    assert sorted(p.name for p in (tmp_path / "ddp2" / "checkpoints").iterdir()) == [
        "ckpt_000003.pt", "ckpt_000004.pt"]
    for name, grid in {"back-fsdp2": TP2_FSDP2, "back-ddp2": TP2_DDP2}.items():
        run_dir = tmp_path / name
        run_ppo(run_dir, *SMALL, *grid, "loop.total_env_steps=2048",
                f"loop.resume={tmp_path / 'ddp2'}")
        assert [row["update"] for row in metrics(run_dir)] == [5.0]
        resumed[name] = _resumed(run_dir, r"ckpt_000004\.pt", 4)
    assert _close(resumed["back-fsdp2"], resumed["back-ddp2"]), resumed


def test_a_corrupt_shard_skips_the_newest_sharded_checkpoint_naming_it(
    tp2_fsdp2_run: Path, tmp_path: Path,
) -> None:
    source = tmp_path / "crashed"
    shutil.copytree(tp2_fsdp2_run / "checkpoints", source / "checkpoints")
    newest = source / "checkpoints" / "ckpt_000002"
    shard = newest / "__3_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 1
    shard.write_bytes(bytes(raw))
    (source / "checkpoints" / "ckpt_000003.tmp").mkdir()  # a write cut short
    run_dir = tmp_path / "second"
    proc = run_app("loop.progress=false", f"hydra.run.dir={run_dir}", *SMALL, *TP2_FSDP2,
                   "loop.total_env_steps=1024", f"loop.resume={source}")
    assert proc.returncode == 0, describe(proc)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: loop.resume: skipped {newest}: corrupt (__3_0.distcp does "
                        "not match its checksum); resuming from ckpt_000001"], describe(proc)
    assert [row["update"] for row in metrics(run_dir)] == [2.0]
    _resumed(run_dir, "ckpt_000001", 1)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["ckpt_000002"]


def test_a_sharded_checkpoint_of_another_width_is_refused_before_any_rank_starts(
    tp2_fsdp2_run: Path, tmp_path: Path,
) -> None:
    run_dir = tmp_path / "second"
    proc = run_app("loop.progress=false", f"hydra.run.dir={run_dir}", *SMALL, *TP2_FSDP2,
                   "loop.model.width=32", f"loop.resume={tp2_fsdp2_run}")
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines() == [
        "error: loop.resume: checkpoint has loop.model.width=16, this run 32"], describe(proc)
    assert not (run_dir / "logs").exists()


@pytest.mark.parametrize("hand_off", ["sharded", "elastic-sharded"])
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
    # the whole model, read from the shards on this one process, bit for bit (assembled by
    # each rollout rank from the four owners' slices).
    checkpoint = run_dir / "checkpoints" / f"ckpt_{version - 1:06d}"
    policy = load_policy_state(checkpoint)
    whole = float(sum(t.double().sum() for t in policy.values()))
    for rank in range(4, 8):
        assert reports[rank]["weights_version"] == version, reports[rank]
        assert reports[rank]["param_checksum"] == whole, rank
    # Each element left one trainer (static or elastic rollout ranks alike): together they
    # sent the whole weights once per version to each of the 4 rollout ranks, and none sent
    # more than half of them.
    normalizers = torch.load(checkpoint / "state.pt", weights_only=False)["normalizers"]
    whole_bytes = sum(t.nbytes for t in [*policy.values(), *normalizers.values()])
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
    # Through the sharded hand-off of elastic rollout ranks: every owner's slices, re-formed
    # job-wide when rank 7 left and when it was admitted (a new epoch on every trainer).
    assert {reports[r]["hand_off"] for r in range(8)} == {"elastic-sharded"}
    (leave,) = result["leaves"]
    assert leave["rank"] == 7
    assert all(reports[r]["epoch"] >= 1 for r in range(4)), [reports[r] for r in range(4)]
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
