"""A time-limit cut on the off-policy path: the worker keeps the cut episode's true last
observation (SAME_STEP autoreset hands back the reset one) and adds nothing to the reward; the
replay bootstraps from that observation with the learner's networks, and a terminated episode
does not bootstrap (the hand computation: tests/unit/test_replay.py)."""

from __future__ import annotations

import pytest
import torch

from app.loops.dqn import DQN, DQNSettings
from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.replay.buffer import ReplaySettings
from app.runtime.rollout.worker import Agent, RolloutWorker, as_segment

pytestmark = pytest.mark.unit


def test_a_cut_episode_keeps_its_final_observation_and_bootstraps_from_it() -> None:
    # CartPole cut after 5 steps: random play needs more steps than that to fall, so every
    # episode ends by truncation, after steps 4 and 9 of a 12-step segment.
    env = EnvConfig(kwargs={"max_episode_steps": 5})
    spaces = probe_spaces(env)
    gamma = 0.9
    algorithm = DQN(DQNSettings(num_envs=2, num_steps=12, gamma=gamma), spaces,
                    replay=ReplaySettings(capacity=64, batch_size=4, min_size=0, tolerance=4.0))
    agent = Agent(algorithm.build(), spaces, env)
    worker = RolloutWorker(algorithm, spaces, env, agent, seed=3)
    packed, episodes = worker.collect(agent, 0)
    worker.close()
    seg = as_segment(worker.segment_format, packed)
    assert [n for _, n in episodes] == [5, 5, 5, 5]
    cut = seg["truncated"].sum(1)
    assert cut.tolist() == [2.0 if t in (4, 9) else 0.0 for t in range(12)]
    assert torch.equal(seg["rewards"], torch.ones(12, 2))  # no value folded into the reward
    final = seg["final_obs"]
    for t in (4, 9):
        # The true last observation: one physics step on from obs[t], not the reset obs[t + 1].
        assert (final[t] - seg["obs"][t]).abs().max() < 0.5
        assert not torch.equal(final[t], seg["obs"][t + 1])
        assert seg["dones"][t + 1].tolist() == [1.0, 1.0]
    assert final[[t for t in range(12) if t not in (4, 9)]].abs().max() == 0
    replay = algorithm.replay.shard  # this trainer's own shard (a LocalReplay's)
    replay.insert(seg)
    slots = lambda t: slice(2 * t, 2 * t + 2)  # noqa: E731 (time-major: slot = t * N + i)
    for t in (4, 9):
        assert torch.equal(replay.storage["next_obs"][slots(t)], final[t])
        assert replay.storage["discounts"][slots(t)].tolist() == pytest.approx([gamma, gamma])
    assert replay.storage["discounts"][slots(3)].tolist() == pytest.approx([gamma, gamma])
    assert torch.equal(replay.storage["next_obs"][slots(3)], seg["obs"][4])
