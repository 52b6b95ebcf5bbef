"""An algorithm, its agent and a rollout worker on CartPole in one process, and a PPO run of
them (tests/unit/test_ppo_core.py, tests/unit/test_vtrace.py,
tests/integration/test_single_process_learning.py)."""

from __future__ import annotations

import torch

from app.loops.ppo.core import PPO, PPOSettings
from app.loops.vtrace.core import VTrace, VTraceSettings
from app.runtime import UpdateInfo
from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.rollout.worker import Agent, RolloutWorker, as_segment


def ppo_parts(seed: int, settings: PPOSettings, env: EnvConfig | None = None
              ) -> tuple[PPO, Agent, RolloutWorker]:
    env = env or EnvConfig()
    torch.manual_seed(seed)
    spaces = probe_spaces(env)
    algorithm = PPO(settings, spaces)
    agent = Agent(algorithm.build(), spaces, env)
    return algorithm, agent, RolloutWorker(algorithm, spaces, env, agent, seed)


def train_ppo(seed: int, updates: int, settings: PPOSettings) -> tuple[Agent, list[tuple[float, int]]]:
    """Single-worker PPO run; returns the agent and all finished episodes in order."""
    algorithm, agent, worker = ppo_parts(seed, settings)
    optimizer = algorithm.optimizer(agent.net)
    generator = torch.Generator().manual_seed(seed)
    episodes: list[tuple[float, int]] = []
    for update in range(updates):
        packed, finished = worker.collect(agent, update)
        episodes += finished
        info = UpdateInfo(optimizer, generator, update * settings.num_envs * settings.num_steps, update, 0)
        algorithm.update(agent.net, agent.net, [as_segment(worker.segment_format, packed)], info)
    worker.close()
    return agent, episodes


def vtrace_parts(seed: int, settings: VTraceSettings) -> tuple[VTrace, Agent, RolloutWorker]:
    env = EnvConfig()
    torch.manual_seed(seed)
    spaces = probe_spaces(env)
    algorithm = VTrace(settings, spaces)
    agent = Agent(algorithm.build(), spaces, env)
    return algorithm, agent, RolloutWorker(algorithm, spaces, env, agent, seed)
