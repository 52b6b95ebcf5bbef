"""A resume through ``python -m app`` (docs/data-safety.md): one of another hidden size is
refused before any rank starts, a 2t2r checkpoint resumes on 1t3r, and a truncated newest
checkpoint is skipped, naming it, with a stale ``.tmp`` ignored. Checkpoint files themselves
are tests/unit/test_resume.py."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.helpers.apprun import describe, metrics, read_result, run_app, run_ppo

pytestmark = pytest.mark.e2e


SMALL = ("loop.hparams.num_envs=4", "loop.hparams.num_steps=64", "loop.target_return=1e9",
         "loop.checkpoint_every=1")


@pytest.fixture(scope="module")
def finished_2t2r(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2t2r run: 2 updates of 512 env steps, a checkpoint after each."""
    run_dir = tmp_path_factory.mktemp("resume") / "first"
    run_ppo(run_dir, "layout=2t2r", *SMALL, "loop.total_env_steps=1024")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "ckpt_000001.pt", "ckpt_000002.pt"]
    return run_dir


def test_a_resume_with_another_hidden_size_is_refused_before_any_rank_starts(
    finished_2t2r: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "second"
    proc = run_app("loop.progress=false", f"hydra.run.dir={run_dir}", "layout=2t2r", *SMALL,
                   "loop.total_env_steps=2048", f"loop.resume={finished_2t2r}",
                   "loop.hparams.hidden_size=32")
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines() == [
        "error: loop.resume: checkpoint has loop.hparams.hidden_size=64, this run 32"], describe(proc)
    assert not (run_dir / "logs").exists()  # no rank ever started


def test_a_2t2r_checkpoint_resumes_on_1t3r_with_a_larger_budget(
    finished_2t2r: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "second"
    # 1t3r: 3 collectors x 256 env steps per update; from 1024 env steps, one more update.
    result = run_ppo(run_dir, "layout=1t3r", *SMALL, "loop.total_env_steps=1792",
                     f"loop.resume={finished_2t2r}")
    trainer = next(r["result"] for r in result["ranks"] if r["rank"] == 0)
    assert (trainer["updates"], trainer["env_steps"]) == (3, 1792), trainer
    assert "resumed from" in (run_dir / "logs" / "rank0.log").read_text()
    assert re.search(r"resumed from \S+/ckpt_000002\.pt at update 2",
                     (run_dir / "logs" / "rank0.log").read_text())
    assert [r["update"] for r in metrics(run_dir)] == [3.0]
    assert read_result(run_dir)["status"] == "ok"


def test_a_truncated_newest_checkpoint_is_skipped_naming_it_and_a_stale_tmp_is_ignored(
    finished_2t2r: Path, tmp_path: Path
) -> None:
    source = tmp_path / "crashed"
    shutil.copytree(finished_2t2r / "checkpoints", source / "checkpoints")
    newest = source / "checkpoints" / "ckpt_000002.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    (source / "checkpoints" / "ckpt_000003.tmp").write_bytes(b"half a checkpoint")
    run_dir = tmp_path / "second"
    # layout=single: 256 env steps per update; from update 1 (512 env steps), one more update.
    proc = run_app("loop.progress=false", f"hydra.run.dir={run_dir}", "layout=single", *SMALL,
                   "loop.total_env_steps=768", f"loop.resume={source}")
    assert proc.returncode == 0, describe(proc)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, describe(proc)
    assert warnings[0].startswith(
        f"warning: loop.resume: skipped {newest}: not a readable checkpoint (truncated or corrupt"
    ), describe(proc)
    assert warnings[0].endswith("; resuming from ckpt_000001.pt"), describe(proc)
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert re.search(r"resumed from \S+/ckpt_000001\.pt at update 1", log), log
    assert read_result(run_dir)["ranks"][0]["result"]["updates"] == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["ckpt_000002.pt"]
    # The source run is read, never changed.
    assert sorted(p.name for p in (source / "checkpoints").iterdir()) == [
        "ckpt_000001.pt", "ckpt_000002.pt", "ckpt_000003.tmp"]
