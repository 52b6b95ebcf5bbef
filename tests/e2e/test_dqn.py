"""``python -m app loop=dqn`` as a user runs it: DQN solves CartPole-v1 on its own layout (one
rank) with the replay's columns in metrics.csv, runs on 2t2r (trainers and rollout ranks) and ends
cleanly, learning starts once the whole run holds ``min_size`` transitions on one trainer and on
two, a resumed run keeps the replay's counters and refills it before learning, and bad
replay settings or a continuous env are one line and exit 2 before any rank
starts (docs/off-policy.md)."""

from __future__ import annotations

import math
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from app.loops.dqn import dqn_replay
from app.runtime.replay.offpolicy import REPLAY_FIGURES
from tests.helpers.apprun import AppProcess, describe, metrics, read_result, run_app

pytestmark = pytest.mark.e2e

QUIET = ("loop.progress=false", "loop.checkpoint_every=0")


def test_dqn_solves_cartpole_on_its_own_layout_and_records_the_replay(tmp_path: Path) -> None:
    # No layout given: loop=dqn's own, one rank that learns and collects.
    proc = run_app("loop=dqn", "seed=1", *QUIET, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    assert "layout: single (loop=dqn's default; layout=... to choose another)" in (
        proc.stdout + proc.stderr), describe(proc)
    result = read_result(tmp_path)
    rank = result["ranks"][0]["result"]
    assert rank["reached_target"], (rank["mean_return_last_window"], rank["env_steps"])
    assert rank["mean_return_last_window"] >= 475
    rows = metrics(tmp_path)
    assert set(REPLAY_FIGURES) <= set(rows[0])
    last, replay = rows[-1], dqn_replay()  # the loop.replay defaults
    assert last["replay_inserts"] == last["env_steps"]  # one rank: every step went in
    assert 0 < last["replay_size"] <= replay.capacity and last["replay_samples"] > 0
    # The ratio held is the declared one within the limiter's tolerance.
    drift = abs(last["samples_per_insert"] - replay.samples_per_insert) * (
        last["replay_inserts"] - replay.min_size)
    assert drift <= replay.tolerance + replay.batch_size, drift
    assert rows[0]["learner_wait"] == 1.0  # the learner waited for min_size
    # result.json and the closing summary show the replay as the last update left it.
    shown = result["summary"]["replay"]
    assert shown["replay_inserts"] == last["replay_inserts"]
    assert shown["learner_wait_updates"] == sum(int(r["learner_wait"]) for r in rows) >= 1
    assert (f"replay: {last['replay_size']:,.0f} transitions per trainer, "
            f"{last['replay_inserts']:,.0f} inserted, ") in proc.stdout, describe(proc)


def test_the_progress_line_shows_the_replay(tmp_path: Path) -> None:
    proc = run_app("loop=dqn", "layout=single", "loop.checkpoint_every=0",
                   "loop.total_env_steps=2048", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    last = [line for line in proc.stderr.splitlines() if line.startswith("[rank0] dqn:")][-1]
    assert "replay 2,048 at " in last and " samples/insert, " in last, last


def test_dqn_on_2t2r_learns_from_rollout_ranks_and_ends(tmp_path: Path) -> None:
    proc = run_app("loop=dqn", "layout=2t2r", "seed=1", *QUIET, "loop.total_env_steps=6144",
                   "loop.replay.min_size=512", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    assert "layout: 2t2r (layout=2t2r on the command line)" in proc.stdout + proc.stderr
    result = read_result(tmp_path)
    assert sorted(r["role"] for r in result["ranks"]) == ["rollout", "rollout", "trainer",
                                                          "trainer"]
    rows = metrics(tmp_path)
    assert rows[-1]["env_steps"] >= 6144
    # Each trainer's shard got its rollout rank's segments: half the env steps, averaged.
    assert rows[-1]["replay_inserts"] == rows[-1]["env_steps"] / 2
    assert sum(r["learner_steps"] for r in rows) > 0
    assert all(math.isfinite(r["td_loss"]) for r in rows if r["learner_steps"] > 0)
    # The trainers agreed on their step counts (DDP would hang otherwise) and both wrote the
    # same weights to their rollouts.
    trainers = [r["result"] for r in result["ranks"] if r["role"] == "trainer"]
    assert trainers[0]["param_checksum"] == pytest.approx(trainers[1]["param_checksum"])


@pytest.mark.parametrize("layout", ["single", "2t2r"])
def test_learning_starts_once_the_whole_run_has_collected_min_size_transitions(
        layout: str, tmp_path: Path) -> None:
    """``loop.replay.min_size`` is the whole run's, as CleanRL's ``learning_starts``: moving from
    one trainer to two does not make the learner start later."""
    min_size = 512
    proc = run_app("loop=dqn", f"layout={layout}", "seed=1", *QUIET, "loop.total_env_steps=1536",
                   f"loop.replay.min_size={min_size}", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    rows = metrics(tmp_path)
    first = next(i for i, r in enumerate(rows) if r["learner_steps"] > 0)
    per_update = rows[0]["env_steps"]  # every collector's segment: 128 per collector
    assert rows[first]["env_steps"] >= min_size, rows[first]
    assert rows[first]["env_steps"] < min_size + per_update, (rows[first], per_update)
    assert all(r["learner_steps"] == 0 for r in rows[:first])


def test_a_resumed_run_keeps_the_replay_counters_and_refills_before_learning(
        tmp_path: Path) -> None:
    common = ("loop=dqn", "layout=single", "seed=1", "loop.progress=false",
              "loop.replay.min_size=512")
    first = run_app(*common, "loop.total_env_steps=2048", "loop.checkpoint_every=8",
                    f"hydra.run.dir={tmp_path / 'a'}")
    assert first.returncode == 0, describe(first)
    before = metrics(tmp_path / "a")[-1]
    second = run_app(*common, "loop.total_env_steps=3072", f"loop.resume={tmp_path / 'a'}",
                     f"hydra.run.dir={tmp_path / 'b'}")
    assert second.returncode == 0, describe(second)
    rows = metrics(tmp_path / "b")
    # The counters go on from the checkpoint; the shard starts empty and refills.
    assert rows[0]["replay_inserts"] == before["replay_inserts"] + 128
    assert rows[0]["replay_samples"] == before["replay_samples"]
    assert rows[0]["replay_size"] == 128 and rows[0]["learner_wait"] == 1.0
    waiting = [r["learner_wait"] for r in rows]
    assert waiting[:3] == [1.0, 1.0, 1.0] and 0.0 in waiting  # learns again from min_size
    assert rows[-1]["replay_samples"] > before["replay_samples"]


@pytest.mark.parametrize(("overrides", "line"), [
    (("loop.replay.capacity=32", "loop.replay.min_size=0"),
     "error: loop.replay.capacity: must be at least batch_size (64), got 32"),
    (("loop.replay.samples_per_insert=0",),
     "error: loop.replay.samples_per_insert: must be > 0, got 0.0"),
    (("loop.replay.n_step=17",),
     "error: loop.replay.n_step: must be in [1, 16] (a segment's steps, hparams.num_steps), got 17"),
    (("loop.env.id=Pendulum-v1",), "error: loop.env.id: Pendulum-v1: action space Box("),
], ids=["capacity < batch", "ratio <= 0", "n-step past a segment", "continuous env"])
def test_bad_input_is_one_line_and_exit_2_before_launch(overrides: tuple[str, ...], line: str,
                                                        tmp_path: Path) -> None:
    proc = run_app("loop=dqn", *overrides, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, describe(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(line), last
    assert not (tmp_path / "logs").exists()  # no rank started


def test_a_killed_collector_loses_only_its_unsent_transitions_counted(
    start_app: Callable[..., AppProcess],
) -> None:
    """Elastic rollout ranks under DQN (1t3r): rank 3 is SIGKILLed mid-run; the run goes on with
    the other two, every transition that reached the trainer stays in its replay, and what the
    lost rank had in flight is counted (docs/off-policy.md)."""
    app = start_app("dqn_killed", "loop=dqn", "layout=1t3r", "seed=1", "loop.progress=false",
                    "loop.total_env_steps=12288", "loop.replay.min_size=512", "comm.timeout=60")
    app.wait_until("8 updates", lambda: len(_rows(app.run_dir)) >= 8)
    process = app.ranks()[3]
    assert process.name() == "rlcomm-rank3", process.name()
    process.send_signal(signal.SIGKILL)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    (leave,) = result["leaves"]
    assert leave["rank"] == 3, leave
    rows = metrics(app.run_dir)
    members = [int(r["members"]) for r in rows]
    assert members[0] == 3 and members[-1] == 2, members
    inserts = [r["replay_inserts"] for r in rows]
    assert inserts == sorted(inserts) and inserts[-1] > inserts[members.index(2)]
    # One trainer: every transition it was handed went into its replay, none of the lost ones.
    assert rows[-1]["replay_inserts"] == rows[-1]["env_steps"]
    trainer = next(r for r in result["ranks"] if r["rank"] == 0)["result"]
    assert trainer["segments_discarded"] >= 1  # rank 3's segment in flight, counted


def _rows(run_dir: Path) -> list[str]:
    path = run_dir / "metrics.csv"
    return path.read_text().splitlines()[1:] if path.exists() else []
