"""MuJoCo continuous control (docs/mujoco.md) through ``python -m app``: the layout sweep plans
its 24 jobs, a short Hopper-v5 run learns on each kind of layout, and a resume restores the
observation and reward normalisers. The configs before launch are tests/unit/test_mujoco.py.
The long runs (1M env steps, against CleanRL's published returns) live in the benchmark,
``python -m benchmarks --only mujoco``, not here."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from app.runtime.checkpoints.checkpoint import newest_valid_checkpoint
from tests.helpers.apprun import describe, metrics, read_result, run_app
from tests.helpers.videos import read_frames

# One layout of each kind the MuJoCo path takes: one process that collects and trains
# (single), one trainer whose normaliser merges three rollout ranks' moments (1t3r), DDP
# trainers fed by rollout ranks (2t2r, the app's default), and the experiment's own (1t2r, one
# trainer and two rollout ranks, with its compiled update: what `+experiment=hopper` runs). The
# other shipped layouts are these on one host (1t1r; 2x2 and 2n_split place 2t2r's ranks on
# simulated nodes, whose groups the layout tests cover); tp2dp2 splits the policy over
# TENSOR_PARALLEL and the MLP has no plan for it. A layout named here runs uncompiled, as it
# did before the experiment named its compile setting: compiling has tests of its own.
LAYOUTS = {"single": ("layout=single", "loop.compile=off"),
           "1t3r": ("layout=1t3r", "loop.compile=off"),
           "2t2r": ("layout=2t2r", "loop.compile=off"),
           "the experiment's own": ()}
# A short run: the experiment's settings with a shorter rollout (64 steps per env and update,
# so every layout makes 8-32 updates) and a budget of 16,384 env steps.
SHORT = ("+experiment=hopper", "loop.hparams.num_steps=64", "loop.total_env_steps=16384",
         "loop.progress=false")
UNCOMPILED = ("loop.compile=off",)
TIMEOUT_S = 240  # a short run past this is stuck (each takes 10-30 s on a busy 2-core machine)


@pytest.mark.e2e
def test_the_layout_sweep_plans_its_24_jobs(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", "+experiment=mujoco_layouts", "plan_only=true",
                   f"hydra.sweep.dir={sweep}", timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["rank_by"] == "time_to_target_s"
    jobs = [sorted(o for o in j["overrides"] if o.startswith(("layout=", "loop.", "seed=")))
            for j in summary["jobs"]]
    # Seed outermost: every layout runs once in each third of the sweep.
    assert jobs == [
        sorted([f"layout={layout}", f"loop.max_staleness={k}", f"seed={seed}"])
        for seed in (0, 1, 2) for layout in ("single", "1t1r", "1t3r", "2t2r") for k in (0, 1)
    ]
    assert [j["status"] for j in summary["jobs"]] == ["ok"] * 24


def learned(run_dir: Path) -> tuple[float, float]:
    """(mean return of the episodes that ended in the first update, mean return of the last
    20 episodes at the end)."""
    first = next(r["mean_return"] for r in metrics(run_dir) if not math.isnan(r["mean_return"]))
    final = read_result(run_dir)["summary"]["final_mean_return"]
    return first, final


@pytest.mark.e2e
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_short_hopper_run_learns_on_each_kind_of_layout(layout: str, tmp_path: Path) -> None:
    proc = run_app(*SHORT, *LAYOUTS[layout], "loop.checkpoint_every=0",
                   f"hydra.run.dir={tmp_path}", timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    result = read_result(tmp_path)
    if not LAYOUTS[layout]:  # the start line says whose choice the layout was
        assert "layout: 1t2r (+experiment=hopper's default; layout=... to choose another)" \
            in proc.stdout + proc.stderr, describe(proc)
        assert [r["role"] for r in result["ranks"]] == ["trainer", "rollout", "rollout"]
    assert result["summary"]["env_steps"] >= 16384
    # Learning, not a score: a random Hopper falls within ~20 steps (the first update's episodes
    # return 10-12); 8-32 updates later the last 20 episodes return 70-240 (every shipped layout, seed 0).
    first, final = learned(tmp_path)
    assert final > 3 * first, (first, final, describe(proc))
    # The measured time split covers each rank's loop (docs/mujoco.md).
    for rank in result["ranks"]:
        split = rank["result"]["time_split_s"]
        parts = sum(v for k, v in split.items() if k != "loop")
        assert parts == pytest.approx(split["loop"], abs=0.01)
        if rank["role"] != "trainer":
            assert split["env"] > 0 and split["act"] > 0
        if rank["role"] != "rollout":
            assert split["update"] > 0


@pytest.mark.e2e
def test_a_resumed_hopper_run_restores_the_normalisers(tmp_path: Path) -> None:
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    per_update = 8 * 64  # one rollout rank's env steps per update (1t1r)
    # The learning rate anneals over the experiment's budget (loop.total_env_steps) unless set:
    # a resume that extends the budget states the schedule it was written with.
    base = (*SHORT, *UNCOMPILED, "layout=1t1r", "loop.checkpoint_every=1",
            f"loop.hparams.anneal_env_steps={16 * per_update}")
    proc = run_app(*base, f"loop.total_env_steps={4 * per_update}", f"hydra.run.dir={first}",
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    saved = newest_valid_checkpoint(first).state["normalizers"]
    assert float(saved["obs_norm.count"]) == pytest.approx(1e-4 + 4 * per_update, rel=1e-12)
    assert saved["obs_norm.mean"].shape == (11,) and torch.all(saved["obs_norm.var"] > 0)

    proc = run_app(*base, f"loop.total_env_steps={5 * per_update}", f"loop.resume={first}",
                   f"hydra.run.dir={resumed}", timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    assert f"resumed from {first / 'checkpoints' / 'ckpt_000004.pt'} at update 4" in (
        (resumed / "logs" / "rank0.log").read_text())
    after = newest_valid_checkpoint(resumed).state["normalizers"]
    # Restored, then one more update folded in: the counts go on from the checkpoint's (a
    # normaliser started afresh would count one update's observations).
    for name in ("obs_norm", "reward_norm"):
        assert float(after[f"{name}.count"]) == pytest.approx(1e-4 + 5 * per_update, rel=1e-12)
    assert not torch.equal(after["obs_norm.mean"], saved["obs_norm.mean"])
    assert read_result(resumed)["summary"]["env_steps"] == 5 * per_update
    config = OmegaConf.load(resumed / ".hydra" / "config.yaml")
    assert config.loop.env.id == "Hopper-v5"


@pytest.mark.e2e
def test_a_short_hopper_run_is_evaluated_beside_training_and_watched(tmp_path: Path) -> None:
    """docs/evaluate.md on MuJoCo: evaluations with videos during the run, then
    ``python -m app.evaluate --video`` on its checkpoint; the videos render headless (EGL)."""
    run_dir = tmp_path / "run"
    # 8 updates of 512 env steps, evaluated twice: a best and a last video, no learning needed.
    proc = run_app(*SHORT, *UNCOMPILED, "layout=single", "loop.total_env_steps=4096",
                   "loop.eval_every=4",
                   "loop.eval_episodes=2", "loop.eval_video=true", f"hydra.run.dir={run_dir}",
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    summary = read_result(run_dir)["summary"]
    assert summary["eval"] is not None and math.isfinite(summary["eval"]["return_mean"])
    for name in ("best", "last"):
        frames = read_frames(run_dir / "videos" / f"{name}.mp4")
        assert len(frames) >= 2 and frames[-1].var() > 100
    proc = run_app(str(run_dir), "--episodes", "1", "--video",
                   module=(sys.executable, "-m", "app.evaluate"), timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    result = json.loads(Path(proc.stdout.strip().splitlines()[-1].removeprefix("result: "))
                        .read_text())
    assert math.isfinite(result["return_mean"])
    frames = read_frames(Path(result["videos"][0]))
    assert len(frames) == result["lengths"][0] + 1
    assert min(frame.var() for frame in frames) > 100  # the hopper on its floor, every frame
