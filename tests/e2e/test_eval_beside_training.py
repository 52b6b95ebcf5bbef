"""Evaluation beside training (``loop.eval_every``, docs/evaluate.md) on a real CartPole run:
the evaluations in every record, the stop rule on them, and ``checkpoints/best``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from app.runtime.checkpoints.checkpoint import load_checkpoint
from tests.helpers.apprun import describe, metrics, read_result, run_app
from tests.helpers.videos import read_frames

pytestmark = pytest.mark.e2e

TIMEOUT_S = 300
# A budget far past where training solves CartPole (about 100k env steps), so that the stop rule,
# not the budget, ends the run: the evaluator is niced, and on two cores shared with other
# tests an evaluation can take 100 updates (a run at the default 400k ended on its budget after
# three evaluations, the last of them finishing after the last update).
EVALUATED = ("layout=single", "seed=1", "loop.eval_every=5", "loop.stop_on=eval",
             "loop.target_return=500", "loop.total_env_steps=1200000", "loop.tensorboard=true",
             "loop.eval_video=true")


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory: pytest.TempPathFactory
                  ) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """PPO on CartPole until an evaluation (10 greedy episodes) returns 500, on one rank."""
    run_dir = tmp_path_factory.mktemp("evaluated")
    proc = run_app(*EVALUATED, f"hydra.run.dir={run_dir}", timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    return run_dir, proc


def _evaluation_rows(run_dir: Path) -> list[dict[str, float]]:
    return [row for row in metrics(run_dir) if row["eval_return_mean"] == row["eval_return_mean"]]


def test_cartpole_reaches_an_eval_return_of_500_shown_in_every_record(
    evaluated_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, proc = evaluated_run
    result = read_result(run_dir)
    summary = result["summary"]
    assert summary["solved"] and summary["stop_on"] == "eval", describe(proc)
    assert summary["eval"]["return_mean"] == 500.0 and summary["eval_episodes"] == 10
    assert result["metrics"]["eval_return_mean"] == 500.0
    assert result["metrics"]["best_eval_return"] == 500.0

    # metrics.csv: a row per finished evaluation, with the version and env steps it evaluated.
    rows = _evaluation_rows(run_dir)
    assert len(rows) >= 2, rows
    assert rows[-1]["eval_return_mean"] == 500.0
    versions = [row["eval_version"] for row in rows]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    for row in rows:
        assert row["eval_env_steps"] <= row["env_steps"] and row["eval_version"] % 5 == 0, row
        assert row["eval_return_std"] >= 0 and 0 < row["eval_length_mean"] <= 500

    # TensorBoard, the progress line and the closing summary show them too.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    shown = [e.value for e in events.Scalars("ppo/eval_return_mean")]
    assert shown == pytest.approx([row["eval_return_mean"] for row in rows], rel=1e-6)
    progress = [line for line in proc.stderr.splitlines() if line.startswith("[rank0] ppo:")]
    assert progress[-1].startswith("[rank0] ppo: eval return 500.0 of 500 100% | train "), \
        describe(proc)
    assert f"eval 500.0 (v{int(versions[-1])})" in progress[-1]
    assert (f"eval: mean return 500.0 ± 0.0 over 10 episodes (weights v{int(versions[-1])}, "
            in proc.stdout), describe(proc)
    assert re.search(r"^best: 500\.0 \(weights v\d+, update \d+\) in .*checkpoints/best$",
                     proc.stdout, re.MULTILINE), describe(proc)


def test_the_best_and_the_last_evaluation_leave_a_video(
    evaluated_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, proc = evaluated_run
    files = read_result(run_dir)["summary"]["files"]
    for name in ("best", "last"):
        video = run_dir / "videos" / f"{name}.mp4"
        assert files[f"videos/{name}.mp4"] == str(video)
        assert f"videos/{name}.mp4" in proc.stdout
        frames = read_frames(video)
        assert len(frames) == 501 and frames[250].var() > 100  # a whole 500-step episode
    assert sorted(p.name for p in (run_dir / "videos").iterdir()) == ["best.mp4", "last.mp4"]


def test_the_best_checkpoint_holds_the_best_evaluation_and_resumes_and_evaluates(
    evaluated_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path,
) -> None:
    run_dir, _ = evaluated_run
    summary: dict[str, Any] = read_result(run_dir)["summary"]
    best_path = run_dir / "checkpoints" / "best"
    assert summary["best_checkpoint"]["path"] == str(best_path)
    best = load_checkpoint(best_path)  # verified against its checksum
    top = max(_evaluation_rows(run_dir), key=lambda row: row["eval_return_mean"])
    assert best["eval"]["return_mean"] == top["eval_return_mean"] == 500.0
    assert best["eval"]["version"] == top["eval_version"] == summary["best_checkpoint"]["version"]
    assert best["update"] == summary["best_checkpoint"]["update"]

    # python -m app.evaluate on it, and a new run resumed from it. The same starts as the
    # evaluation that made it best (loop.eval_seed's): the greedy policy plays them alike.
    # Other starts may score lower: which version becomes best depends on timing.
    eval_seed = str(OmegaConf.load(run_dir / ".hydra" / "config.yaml").loop.eval_seed)
    proc = run_app(str(run_dir), "--checkpoint", "best", "--episodes", "5", "--seed", eval_seed,
                   module=(sys.executable, "-m", "app.evaluate"), timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    found = json.loads(Path(proc.stdout.strip().splitlines()[-1].removeprefix("result: "))
                       .read_text())
    assert found["checkpoint"] == str(best_path) and found["return_mean"] >= 475, found
    resumed = tmp_path / "resumed"
    budget = best["env_steps"] + 2 * 1024  # two more updates
    proc = run_app("layout=single", "loop.progress=false", f"loop.resume={best_path}",
                   f"loop.total_env_steps={budget}", "loop.stop_at_target=false",
                   f"hydra.run.dir={resumed}",
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    assert f"resumed from {best_path} at update {best['update']}" in proc.stderr + proc.stdout
    assert read_result(resumed)["summary"]["updates"] == best["update"] + 2
