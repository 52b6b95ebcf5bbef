"""An off-policy update reports the seconds it spent in the replay (``replay_s``: inserting,
sampling, writing priorities), the part of the update that is not the learner's, so that
``metrics.csv`` and ``python -m benchmarks.offpolicy`` split replay from learning
(docs/off-policy.md, docs/benchmarks.md)."""

from __future__ import annotations

import time

import pytest
import torch

from app.loops.dqn import DQN, DQNSettings
from app.runtime import UpdateInfo
from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.replay.buffer import ReplaySettings
from app.runtime.replay.offpolicy import REPLAY_FIGURES
from app.runtime.rollout.worker import Agent, RolloutWorker, as_segment

pytestmark = pytest.mark.unit


def test_an_update_reports_its_seconds_in_the_replay_apart_from_learning() -> None:
    env = EnvConfig()
    torch.manual_seed(0)
    spaces = probe_spaces(env)
    replay = ReplaySettings(capacity=512, batch_size=16, min_size=48, samples_per_insert=2.0,
                            tolerance=16.0, prioritized=True)
    algorithm = DQN(DQNSettings(num_envs=2, num_steps=16), spaces, replay=replay)
    agent = Agent(algorithm.build(), spaces, env)
    worker = RolloutWorker(algorithm, spaces, env, agent, seed=0)
    optimizer = algorithm.optimizer(agent.net)
    assert "replay_s" in REPLAY_FIGURES and "replay_s" in DQN.losses  # a metrics.csv column
    rows, walls = [], []
    for update in range(5):
        packed, _ = worker.collect(agent, update)
        info = UpdateInfo(optimizer, torch.Generator().manual_seed(update), 32 * (update + 1),
                          update, 0)
        tick = time.perf_counter()
        rows.append(algorithm.update(agent.net, agent.net,
                                     [as_segment(worker.segment_format, packed)], info))
        walls.append(time.perf_counter() - tick)
    worker.close()
    # Every update inserts (time in the replay), and that time is part of the update's.
    assert all(0 < row["replay_s"] <= wall for row, wall in zip(rows, walls))
    learning = [(row, wall) for row, wall in zip(rows, walls) if row["learner_steps"] > 0]
    assert learning and rows[0]["learner_steps"] == 0
    # With learner steps, the update holds the learner's forward and backward passes besides.
    assert sum(row["replay_s"] for row, _ in learning) < sum(wall for _, wall in learning)
