"""Checkpoint cadence, retention and background writes (docs/data-safety.md, "Cadence and
retention"), on real files: which checkpoint is due, which are kept, milestones, and what a
background write that fails does."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest
import torch

from app.runtime.checkpoints.cadence import Cadence
from app.runtime.checkpoints.checkpoint import TrainingState, save_checkpoint
from app.runtime.checkpoints.retention import (
    MILESTONES,
    REPLAY,
    is_milestone,
    keep_as_milestone,
    kept_checkpoints,
    retire,
)
from app.runtime.checkpoints.writes import BackgroundWrites

pytestmark = pytest.mark.unit


def _write(run_dir: Path, update: int, name: str | None = None) -> Path:
    policy = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(policy.parameters())
    return save_checkpoint(run_dir, policy, optimizer, TrainingState(update, update * 8),
                           name=name)


def test_by_updates_the_count_decides_and_by_time_the_seconds_since_the_last() -> None:
    by_updates = Cadence(every=5)
    assert [u for u in range(1, 16) if by_updates.due(u, 1e9, None)] == [5, 10, 15]
    by_time = Cadence(every=None, every_s=60.0)
    assert not by_time.due(3, 59.9, None) and by_time.due(3, 60.0, None)
    assert not by_time.due(9, 100.0, (5, 60.0)) and by_time.due(9, 120.0, (5, 60.0))
    assert not Cadence(every=None, every_s=0.0).due(10, 1e9, None)  # only the last one
    off = Cadence(every=0)
    assert not off.on and not off.due(10, 1e9, None)


def test_bad_cadence_and_keep_counts_are_named_with_their_values() -> None:
    assert Cadence(every=-1).range_errors() == ["checkpoint_every: must be >= 0 (or null), got -1"]
    assert Cadence(every_s=-5.0).range_errors() == ["checkpoint_every_s: must be >= 0, got -5.0"]
    assert Cadence(keep=-1).range_errors() == ["checkpoint_keep: must be >= 0, got -1"]
    assert Cadence(keep=0).range_errors() == [
        "checkpoint_keep: must be >= 1 while checkpoints are on (loop.checkpoint_every=0 turns "
        "them off), got 0"]
    assert Cadence(every=0, keep=0).range_errors() == []
    assert Cadence(milestone_every=-2).range_errors() == ["milestone_every: must be >= 0, got -2"]


def test_a_milestone_is_the_first_checkpoint_at_or_past_each_multiple() -> None:
    written, marks, last = [3, 6, 9, 12, 15, 21, 24], [], None
    for update in written:
        if is_milestone(last, (update, 0.0), every=10, every_s=0.0):
            marks.append(update)
        last = (update, 0.0)
    assert marks == [12, 21]
    assert is_milestone((4, 59.0), (5, 61.0), every=0, every_s=60.0)
    assert not is_milestone((4, 61.0), (5, 119.0), every=0, every_s=60.0)


def test_retirement_keeps_the_newest_k_best_and_milestones_and_their_replay_shards(
    tmp_path: Path,
) -> None:
    for update in (2, 4, 6, 8):
        _write(tmp_path, update)
    _write(tmp_path, 5, name="best")
    folder = tmp_path / "checkpoints"
    milestone = keep_as_milestone(folder / "ckpt_000004.pt")
    shards = folder / REPLAY
    shards.mkdir()
    for update in (2, 4, 6, 8):
        (shards / f"ckpt_{update:06d}.shard0.pt").write_bytes(b"x")
    removed = retire(folder, keep=2)
    assert sorted(p.name for p in removed) == ["ckpt_000002.pt", "ckpt_000004.pt"]
    assert [p.name for p in kept_checkpoints(folder)] == ["ckpt_000008.pt", "ckpt_000006.pt"]
    assert (folder / "best").exists()
    assert milestone == folder / MILESTONES / "ckpt_000004.pt" and milestone.stat().st_size > 0
    assert sorted(p.name for p in shards.iterdir()) == ["ckpt_000006.shard0.pt",
                                                        "ckpt_000008.shard0.pt"]


def test_a_background_write_runs_one_at_a_time_and_counts_the_wait() -> None:
    writes, release = BackgroundWrites(), threading.Event()
    order: list[str] = []
    writes.submit(lambda: (release.wait(5), order.append("first")), "first")
    assert writes.busy
    threading.Timer(0.2, release.set).start()
    tick = time.perf_counter()
    writes.submit(lambda: order.append("second"), "second")  # waits for the first
    assert time.perf_counter() - tick >= 0.1
    writes.wait()
    assert order == ["first", "second"]
    assert writes.waits == 1 and writes.waited_s > 0.1 and writes.writes == 2


def test_a_failed_background_write_is_raised_in_the_training_thread_once() -> None:
    writes = BackgroundWrites()

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/run/checkpoints/ckpt_1.pt")

    writes.submit(full_disk, "ckpt_1")
    with pytest.raises(OSError) as caught:
        writes.wait()
    assert caught.value.errno == errno.ENOSPC
    writes.check()  # raised once: the run ended there
