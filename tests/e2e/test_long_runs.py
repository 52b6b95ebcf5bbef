"""A run's cost does not grow with its length (docs/data-safety.md, "What grows with a run"):
checkpoints of a constant size, kept to the newest few, written beside training; the history in
append-only files that a resume cuts back to its checkpoint, on the restart path and the
elastic path; a stop asked by SIGTERM ends with a checkpoint; and an off-policy run can keep
its replay across a restart. Real ``python -m app`` runs, every process checked to have ended.
"""

from __future__ import annotations

import csv
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.apprun import AppProcess, describe, read_result, rows_so_far, run_app

pytestmark = pytest.mark.e2e

# PPO on one rank, 64 env steps an update: hundreds of updates in seconds.
TINY = ("layout=single", "loop.hparams={num_envs:4,num_steps:16}", "loop.progress=false",
        "loop.stop_at_target=false")
# PPO on the default layout's four ranks, 512 env steps an update (2 rollout ranks x 4 x 64).
SMALL = ("loop.hparams={num_envs:4,num_steps:64}", "loop.progress=false",
         "loop.target_return=10", "loop.stop_at_target=false")
STEPS_PER_UPDATE = 2 * 4 * 64


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("ckpt_*") if not p.name.endswith(".tmp"))


def episodes(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "episodes.csv").open() as handle:
        return list(csv.DictReader(handle))


def assert_history_once(run_dir: Path, updates: int) -> None:
    """metrics.csv has every update once, in order; episodes.csv every episode once, numbered
    on from 1, each at an update metrics.csv has, as many per update as its row counted."""
    rows = rows_so_far(run_dir)
    assert [int(r["update"]) for r in rows] == list(range(1, updates + 1)), \
        [r["update"] for r in rows]
    found = episodes(run_dir)
    assert [int(e["episode"]) for e in found] == list(range(1, len(found) + 1))
    per_update: dict[int, int] = {}
    for episode in found:
        per_update[int(episode["update"])] = per_update.get(int(episode["update"]), 0) + 1
    assert per_update == {int(r["update"]): int(r["episodes"]) for r in rows
                          if int(r["episodes"])}, per_update


class FolderWatch:
    """The most checkpoints a folder held at once, read every few milliseconds while a run
    goes on."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.most, self._stop = folder, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            if self.folder.is_dir():
                self.most = max(self.most, len(checkpoint_files(self.folder)))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.most


def test_a_checkpoint_every_update_stays_the_same_size_and_only_the_newest_are_kept(
    start_app: Callable[..., AppProcess],
) -> None:
    updates, keep = 300, 2
    app = start_app("flat", *TINY, f"loop.total_env_steps={updates * 64}",
                    "loop.checkpoint_every=1", f"loop.checkpoint_keep={keep}",
                    "loop.milestone_every=10")
    folder = app.run_dir / "checkpoints"
    watch = FolderWatch(folder)
    assert app.wait() == 0, app.describe()
    most = watch.stop()
    app.assert_all_ended()
    kept = checkpoint_files(folder)
    assert [p.name for p in kept] == [f"ckpt_{u:06d}.pt" for u in (updates - 1, updates)]
    assert 0 < most <= keep + 1, most  # the new one is durable before the oldest goes
    # Milestones: the first checkpoint at or past every 10 updates, beside the newest.
    milestones = sorted(p.name for p in (folder / "milestones").iterdir())
    assert milestones == [f"ckpt_{u:06d}.pt" for u in range(10, updates + 1, 10)], milestones
    tenth, last = (folder / "milestones" / "ckpt_000010.pt").stat().st_size, kept[-1].stat().st_size
    assert abs(last - tenth) <= 0.1 * tenth, (tenth, last)
    result = read_result(app.run_dir)
    trainer = result["ranks"][0]["result"]
    assert trainer["checkpoints_written"] == updates, trainer
    assert_history_once(app.run_dir, updates)
    # The checkpoint records where the history files stood, not the history itself.
    state = torch.load(kept[-1], weights_only=True)
    assert "metrics" not in state and len(state["episodes"]) <= 100
    assert state["history"]["files"]["metrics.csv"][0] == updates
    assert state["episodes_done"] == len(episodes(app.run_dir))


def test_a_restart_cuts_the_history_back_to_its_checkpoint(
    start_app: Callable[..., AppProcess],
) -> None:
    """The restart path: a killed trainer restarts every rank from the newest checkpoint;
    what was written after it is cut, so no update or episode is written twice, and the first
    time the target was reached survives."""
    updates = 30
    app = start_app("restart", *SMALL, f"loop.total_env_steps={updates * STEPS_PER_UPDATE}",
                    "loop.checkpoint_every=4", "launcher.max_restarts=1",
                    "layout.elastic_trainers=false")
    folder = app.run_dir / "checkpoints"
    app.wait_until("a checkpoint and rows past it", lambda: bool(checkpoint_files(folder))
                   and len(rows_so_far(app.run_dir)) >= 6)
    app.ranks()[1].send_signal(signal.SIGKILL)
    assert app.wait() == 0, app.describe()
    app.assert_all_ended()
    resumed = re.findall(r"resumed from \S+ckpt_(\d+)\.pt", app.log(0))
    assert len(resumed) == 1 and 4 <= int(resumed[0]) < updates, app.describe()
    assert_history_once(app.run_dir, updates)
    summary = read_result(app.run_dir)["summary"]
    assert summary["restarts"] == 1 and summary["env_steps_to_target"] is not None, summary
    assert summary["env_steps_to_target"] <= int(resumed[0]) * STEPS_PER_UPDATE, summary


def test_a_lost_elastic_trainer_leaves_the_history_whole(
    start_app: Callable[..., AppProcess],
) -> None:
    """The elastic path: a trainer lost mid-run, the others go on; no update or episode is
    written twice or lost from the files."""
    updates = 40
    app = start_app("elastic", *SMALL, f"loop.total_env_steps={updates * STEPS_PER_UPDATE}",
                    "loop.checkpoint_every=4")
    app.wait_until("updates past a checkpoint", lambda: len(rows_so_far(app.run_dir)) >= 8)
    app.ranks()[1].send_signal(signal.SIGKILL)
    assert app.wait() == 0, app.describe()
    app.assert_all_ended()
    rows = rows_so_far(app.run_dir)
    updates_done = int(rows[-1]["update"])
    assert {int(r["trainers"]) for r in rows} == {1, 2}, [r["trainers"] for r in rows]
    assert_history_once(app.run_dir, updates_done)
    assert read_result(app.run_dir)["summary"]["trainers"]["left"] == 1


@pytest.mark.parametrize("to", ["launcher", "every rank"])
def test_sigterm_stops_at_the_next_update_with_a_checkpoint_that_resumes(
    start_app: Callable[..., AppProcess], to: str,
) -> None:
    """SIGTERM to the launcher (which forwards it) or to every rank (as srun does on
    preemption): the ranks end their update, agree, and the run stops there with a checkpoint
    of that update, from which a new run goes on."""
    app = start_app("stopped", *SMALL, f"loop.total_env_steps={10**9}")
    app.wait_until("a few updates", lambda: len(rows_so_far(app.run_dir)) >= 3)
    assert not checkpoint_files(app.run_dir / "checkpoints")  # one a minute: none yet
    if to == "launcher":
        app.proc.send_signal(signal.SIGTERM)
        assert app.wait() == 128 + signal.SIGTERM, app.describe()
        assert app.last_line.startswith("error: interrupted by SIGTERM"), app.describe()
    else:
        for rank in app.ranks().values():
            rank.send_signal(signal.SIGTERM)
        assert app.wait() == 0, app.describe()
        assert "stopped by SIGTERM after" in app.stdout, app.describe()
        assert read_result(app.run_dir)["summary"]["stopped_by"] == "SIGTERM"
    app.assert_all_ended()
    last = int(rows_so_far(app.run_dir)[-1]["update"])
    assert [p.name for p in checkpoint_files(app.run_dir / "checkpoints")] == [
        f"ckpt_{last:06d}.pt"], app.describe()
    assert f"stopped: asked by SIGTERM at update {last}" in app.log(0), app.log(0)
    more = start_app("resumed", *SMALL, f"loop.resume={app.run_dir}",
                     f"loop.total_env_steps={(last + 2) * STEPS_PER_UPDATE}")
    assert more.wait() == 0, more.describe()
    more.assert_all_ended()
    assert f"at update {last} " in more.log(0), more.log(0)
    assert [int(r["update"]) for r in rows_so_far(more.run_dir)] == [last + 1, last + 2]


@pytest.mark.parametrize(("layout", "holder", "per_update"), [
    ("single", 0, 128),  # the trainer's own shard
    ("replay_server", 1, 256),  # the replay rank's: 2 collectors x 128
], ids=["trainer shard", "replay rank"])
def test_a_dqn_restart_keeps_its_replay_and_learns_on_without_a_warm_up(
    start_app: Callable[..., AppProcess], layout: str, holder: int, per_update: int,
) -> None:
    """loop.replay.checkpoint: each shard is saved with each checkpoint (by the trainer that
    holds it, or by the replay rank) and restored, so the restarted run's first update samples
    from a full replay instead of refilling it."""
    app = start_app("replay", "loop=dqn", f"layout={layout}", "loop.progress=false",
                    "loop.stop_at_target=false", f"loop.total_env_steps={100 * per_update}",
                    "loop.checkpoint_every=10", "loop.replay.checkpoint=true",
                    "loop.replay.min_size=640", "launcher.max_restarts=1")
    folder = app.run_dir / "checkpoints"
    app.wait_until("a checkpoint past the warm-up and its shard", lambda: any(
        int(p.name[5:11]) >= 20 and (folder / "replay" / f"{p.stem}.shard0.pt").exists()
        for p in checkpoint_files(folder)))
    app.ranks()[holder].send_signal(signal.SIGKILL)
    assert app.wait() == 0, app.describe()
    app.assert_all_ended()
    log = app.log(holder)
    restored = re.search(r"restored (\d+) replay transitions from 1 shard\(s\) of ckpt_(\d+)", log)
    assert restored, log
    held, at = int(restored.group(1)), int(restored.group(2))
    assert held == at * per_update, (held, at)  # everything the run had collected by then
    first = next(r for r in rows_so_far(app.run_dir) if int(r["update"]) == at + 1)
    assert int(float(first["replay_size"])) == held + per_update, first
    assert int(float(first["learner_steps"])) > 0, first  # no warm-up: it learns at once
    assert sorted(p.name for p in (folder / "replay").iterdir()) == [
        f"{p.stem}.shard0.pt" for p in checkpoint_files(folder)]  # retired with them


@pytest.mark.parametrize(("overrides", "line"), [
    (("loop.checkpoint_keep=0",), "error: loop.checkpoint_keep: must be >= 1 while checkpoints "
     "are on (loop.checkpoint_every=0 turns them off), got 0"),
    (("loop.checkpoint_every_s=-5",), "error: loop.checkpoint_every_s: must be >= 0, got -5.0"),
    (("loop.replay.checkpoint=true",),
     "error: loop.replay.checkpoint: Key 'replay' not in 'PPOLoopConfig'"),
], ids=["keep 0", "negative cadence", "replay checkpoint on PPO"])
def test_bad_cadence_and_replay_checkpoint_settings_are_one_line_before_launch(
    tmp_path: Path, overrides: tuple[str, ...], line: str,
) -> None:
    done = run_app(*overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2, describe(done)
    assert done.stderr.strip().splitlines() == [line], describe(done)
    assert not (tmp_path / "run" / "logs").exists()  # no rank started
