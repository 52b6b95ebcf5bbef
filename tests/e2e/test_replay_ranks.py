"""``python -m app loop=dqn layout=replay_server`` as a user runs it: the replay on its own
rank (``layout.replay``, docs/off-policy.md "On its own ranks"). DQN learns a little on
CartPole-v1, the replay's figures are the replay rank's and hold the ratio, two replay ranks
share the segments and the batches, every rank ends, and a bad replay layout is one line and
exit 2 before any rank starts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from app.loops.dqn import dqn_replay
from app.runtime.replay.offpolicy import REPLAY_FIGURES
from tests.helpers.apprun import describe, metrics, read_result, run_app

pytestmark = pytest.mark.e2e

QUIET = ("loop.progress=false", "loop.checkpoint_every=0", "seed=1")
SEGMENT = 128  # env steps per segment: DQN's num_envs x num_steps (loop.hparams)


def _ranks(run_dir: Path) -> dict[str, list[dict]]:
    by_role: dict[str, list[dict]] = {}
    for entry in read_result(run_dir)["ranks"]:
        by_role.setdefault(entry["role"], []).append(entry["result"])
    return by_role


def test_dqn_learns_with_its_replay_on_its_own_rank(tmp_path: Path) -> None:
    steps = 12_288
    proc = run_app("loop=dqn", "layout=replay_server", *QUIET, f"loop.total_env_steps={steps}",
                   f"hydra.run.dir={tmp_path}", timeout=240)
    assert proc.returncode == 0, describe(proc)
    ranks = _ranks(tmp_path)  # every rank ended and reported (run_app: no process survived)
    assert sorted((role, len(r)) for role, r in ranks.items()) == [
        ("replay", 1), ("rollout", 2), ("trainer", 1)]
    rows, replay = metrics(tmp_path), dqn_replay()
    assert set(REPLAY_FIGURES) <= set(rows[0])
    last = rows[-1]
    # Every collected step went to the replay rank; the trainer's figures are its counts.
    server = ranks["replay"][0]["replay_server"]
    assert last["env_steps"] >= steps and server["inserts"] == last["env_steps"]
    assert server["segments"] * SEGMENT == server["inserts"]
    assert last["replay_inserts"] == server["inserts"]
    assert last["replay_samples"] == server["samples"] > 0
    assert last["replay_size"] == server["size"] == min(server["inserts"], replay.capacity)
    # The hand-off to the trainer carried no transitions: less than a CartPole observation
    # (16 bytes) per collected step.
    handed = sum(r["trajectory_bytes_sent"] for r in ranks["rollout"])
    assert 0 < handed < 16 * server["inserts"], handed
    # The ratio held is the declared one within the limiter's tolerance, counted there.
    drift = abs(last["samples_per_insert"] - replay.samples_per_insert) * (
        last["replay_inserts"] - replay.min_size)
    assert drift <= replay.tolerance + replay.batch_size, drift
    assert rows[0]["learner_wait"] == 1.0  # the learner waited for min_size
    assert all(math.isfinite(r["td_loss"]) for r in rows if r["learner_steps"] > 0)
    # It learns a little: the last 20 episodes beat the first 20 (a random policy's ~22).
    first = [r["mean_return"] for r in rows[:8] if math.isfinite(r["mean_return"])]
    trainer = ranks["trainer"][0]
    assert trainer["mean_return_last_window"] > 1.5 * (sum(first) / len(first)), (
        first, trainer["mean_return_last_window"])
    assert read_result(tmp_path)["summary"]["replay"]["replay_inserts"] == server["inserts"]


def test_two_replay_ranks_share_the_segments_and_serve_two_trainers(tmp_path: Path) -> None:
    proc = run_app("loop=dqn", "layout=replay_server", "layout.world_size=6",
                   "layout.trainers=[0,1]", "layout.replay=[2,3]", "layout.rollouts=[4,5]",
                   "loop.replay.prioritized=true", "loop.replay.min_size=512",
                   "loop.total_env_steps=3072", *QUIET, f"hydra.run.dir={tmp_path}",
                   timeout=240)
    assert proc.returncode == 0, describe(proc)
    ranks = _ranks(tmp_path)
    assert sorted((role, len(r)) for role, r in ranks.items()) == [
        ("replay", 2), ("rollout", 2), ("trainer", 2)]
    servers = [r["replay_server"] for r in ranks["replay"]]
    rows = metrics(tmp_path)
    last = rows[-1]
    # Collector i writes to replay rank i mod 2: each holds half of what was collected.
    assert [s["inserts"] for s in servers] == [last["env_steps"] / 2] * 2
    # Every learner step of both trainers took its share (64 = 32 + 32) from both replay ranks.
    learner_steps = sum(r["learner_steps"] for r in rows)
    assert servers[0]["batches"] == servers[1]["batches"] == 2 * learner_steps > 0
    assert servers[0]["samples"] == servers[1]["samples"] == servers[0]["batches"] * 32
    # The trainers agreed on their step counts (DDP would hang otherwise): the same weights.
    trainers = ranks["trainer"]
    assert trainers[0]["param_checksum"] == pytest.approx(trainers[1]["param_checksum"])
    # The trainers' new priorities reached both shards: their sampling is no longer uniform.
    assert last["priority_spread"] > 0


@pytest.mark.parametrize(("overrides", "line"), [
    (("loop=ppo", "layout=replay_server"),
     "error: layout.replay: ranks [1] would hold a replay, but PPOLoop does not learn from one"),
    (("loop=dqn", "layout=replay_server", "layout.replay=[2]"),
     "error: layout.replay: ranks [2] are also rollouts; roles must not overlap"),
], ids=["on-policy loop", "overlaps rollouts"])
def test_bad_replay_layouts_are_one_line_and_exit_2_before_launch(
        overrides: tuple[str, ...], line: str, tmp_path: Path) -> None:
    # The planner's other errors (overlapping trainers, out of range) are the same path:
    # tests/unit/test_replay_ranks.py::test_bad_replay_ranks_are_one_line.
    proc = run_app(*overrides, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, describe(proc)
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(line), lines[-1]
    assert not (tmp_path / "logs").exists()  # no rank started
