"""Training runs in one process that learn CartPole: PPO's update over about 30k env steps,
and V-trace's with the rollout acting on weights one update old. No ranks and no child
processes, but seconds of training each: too slow for the unit tier, whose pieces they join
(tests/unit/test_ppo_core.py, tests/unit/test_vtrace.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from app.loops.ppo.core import PPOSettings
from app.loops.vtrace.core import VTraceSettings
from app.runtime import Segment, UpdateInfo
from app.runtime.rollout.worker import as_segment
from tests.helpers.single_process import train_ppo, vtrace_parts

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Multi-threaded BLAS reductions may reorder float sums; one thread is bitwise reproducible.
    torch.set_num_threads(1)


def test_short_training_improves_return() -> None:
    settings = PPOSettings(anneal_env_steps=30_000)  # anneal over this short run
    updates = 30_000 // (settings.num_envs * settings.num_steps) + 1  # ~30k env steps
    _, episodes = train_ppo(seed=0, updates=updates, settings=settings)
    returns = [r for r, _ in episodes]
    first, last = sum(returns[:20]) / 20, sum(returns[-20:]) / 20

    # A random CartPole policy scores ~20; a learning one is far above that.
    assert first < 50
    # Seeds 0-5 give 160-300 here; 100 leaves room for platform-dependent float drift.
    assert last > 100 and last > 4 * first, (first, last)


def test_vtrace_learns_cartpole_with_weights_one_update_stale() -> None:
    """A rollout acting with weights one update old (``loop.max_staleness=1``), single process:
    a few seconds of V-trace lift the return well clear of a random policy's (about 22)."""
    settings = VTraceSettings()
    algorithm, agent, worker = vtrace_parts(0, settings)
    behaviour = copy.deepcopy(agent)  # the rollout's copy: one weights version behind
    optimizer = algorithm.optimizer(agent.net)
    generator = torch.Generator().manual_seed(0)
    episodes: list[float] = []
    for update in range(20):  # 20k env steps; random play returns about 22
        packed, finished = worker.collect(behaviour, update)
        episodes += [ret for ret, _ in finished]
        segment: Segment = as_segment(worker.segment_format, packed, lag=1)
        behaviour.load_state_dict(agent.state_dict())  # what the trainer sent before updating
        env_steps = (update + 1) * settings.num_envs * settings.num_steps
        info = UpdateInfo(optimizer, generator, env_steps, update, 1)
        algorithm.update(agent.net, agent.net, [segment], info)
    worker.close()
    first, last = np.mean(episodes[:20]), np.mean(episodes[-20:])
    assert first < 50 and last > 100, (first, last)
