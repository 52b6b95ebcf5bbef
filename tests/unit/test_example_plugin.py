"""The example plugin (examples/reinforce.py): what it promises of itself, and one update on real
CartPole data in one process. Its distributed runs are end-to-end tests of their own."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from app.runtime import RLLoop, Segment, UpdateInfo
from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.rollout.worker import Agent, RolloutWorker, as_segment
from examples.reinforce import Reinforce, ReinforceLoop, ReinforceSettings, discounted_returns

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).parents[2] / "examples" / "reinforce.py"


def test_the_example_is_one_short_file_that_imports_only_the_runtime_and_torch() -> None:
    source = EXAMPLE.read_text()
    assert len(source.splitlines()) <= 150
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    # The standard library's dataclasses and typing, torch, and the runtime's public modules.
    allowed = ("__future__", "dataclasses", "typing", "torch", "app.api", "app.runtime")
    assert all(m in allowed or m.startswith(("torch.", "app.runtime.")) for m in imported), imported
    # The docstring says how to run it, with the dotted path this file really has.
    assert "loop._target_=examples.reinforce.ReinforceLoop" in source


def test_the_loop_is_a_runtime_loop_with_the_examples_algorithm_and_settings() -> None:
    assert issubclass(ReinforceLoop, RLLoop) and ReinforceLoop.algorithm is Reinforce
    assert isinstance(ReinforceLoop().hparams, ReinforceSettings)
    assert ReinforceSettings().range_errors(batch_per_trainer=1024) == []
    assert ReinforceSettings(lr=0.0, num_minibatches=2000).range_errors(1024) == [
        "lr: must be > 0, got 0.0",
        "num_minibatches: must be in [1, 1024] (the samples each trainer gets), got 2000",
    ]


def test_returns_stop_at_episode_ends_and_bootstrap_at_the_segments_end() -> None:
    segment = Segment({
        "rewards": torch.tensor([[1.0], [1.0], [1.0]]),
        "dones": torch.tensor([[0.0], [0.0], [1.0]]),  # obs[2] starts a new episode
        "next_done": torch.tensor([0.0]),
    })
    returns = discounted_returns(segment, torch.tensor([10.0]), 0.5)
    # Steps 0-1 end with the episode at step 1; step 2 is bootstrapped: 1 + 0.5 * 10.
    torch.testing.assert_close(returns, torch.tensor([[1.5], [1.0], [6.0]]))


def test_one_update_on_real_cartpole_data_runs_and_returns_its_declared_losses() -> None:
    env = EnvConfig()
    torch.manual_seed(0)
    spaces = probe_spaces(env)
    settings = ReinforceSettings(num_envs=4, num_steps=32, num_minibatches=4)
    algorithm = Reinforce(settings, spaces)
    agent = Agent(algorithm.build(), spaces, env)
    worker = RolloutWorker(algorithm, spaces, env, agent, seed=0)
    packed, _ = worker.collect(agent, 0)
    worker.close()
    segment = as_segment(worker.segment_format, packed)
    assert set(segment) >= {"obs", "actions", "rewards", "dones", "next_obs", "next_done"}

    before = [p.detach().clone() for p in agent.net.parameters()]
    optimizer = algorithm.optimizer(agent.net)
    info = UpdateInfo(optimizer, torch.Generator().manual_seed(0), env_steps=128, update=0, lag=0)
    out = algorithm.update(agent.net, agent.net, [segment], info)

    assert list(out) == list(Reinforce.losses)
    assert all(np.isfinite(v) for v in out.values())
    assert any(not torch.equal(a, b) for a, b in zip(before, agent.net.parameters()))
