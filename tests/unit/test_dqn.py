"""DQN (app/loops/dqn): its targets against the papers' formulas on hand-made tensors, the
epsilon schedule, the spaces it refuses, its settings' and its replay's checks before launch,
and one update on the runtime's off-policy path (replay figures, priorities, target copies)."""

from __future__ import annotations

import pytest
import torch
from gymnasium import spaces as gym_spaces
from hydra import compose, initialize_config_dir

from app.errors import ConfigError
from app.launch.planning import validate
from app.loops.dqn import DQN, DQNLoop, DQNSettings, dqn_targets, epsilon_at
from app.runtime import Spaces, UpdateInfo
from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.replay.buffer import ReplaySettings
from app.runtime.replay.offpolicy import REPLAY_FIGURES
from app.runtime.rollout.worker import Agent, RolloutWorker, as_segment
from tests.helpers.apprun import REPO

pytestmark = pytest.mark.unit


def test_the_target_is_r_plus_gamma_n_times_the_target_networks_max() -> None:
    rewards = torch.tensor([1.0, 0.5, -1.0])
    discounts = torch.tensor([0.99**3, 0.0, 0.99])  # n = 3; an ended episode; n = 1
    target_q = torch.tensor([[1.0, 3.0], [7.0, 2.0], [-2.0, -4.0]])
    want = torch.tensor([1.0 + 0.99**3 * 3.0, 0.5, -1.0 + 0.99 * -2.0])
    assert torch.allclose(dqn_targets(rewards, discounts, target_q), want)


def test_the_double_dqn_target_evaluates_the_online_networks_choice() -> None:
    rewards = torch.tensor([1.0, 2.0])
    discounts = torch.tensor([0.9, 0.9])
    target_q = torch.tensor([[1.0, 3.0], [7.0, 2.0]])
    online_q = torch.tensor([[5.0, 0.0], [0.0, 5.0]])  # picks action 0, then action 1
    want = torch.tensor([1.0 + 0.9 * 1.0, 2.0 + 0.9 * 2.0])
    assert torch.allclose(dqn_targets(rewards, discounts, target_q, online_q), want)


def test_epsilon_decays_linearly_then_holds() -> None:
    s = DQNSettings(start_epsilon=1.0, end_epsilon=0.1, exploration_env_steps=1000)
    assert [epsilon_at(s, n) for n in (0, 500, 1000, 5000)] == pytest.approx([1.0, 0.55, 0.1, 0.1])


def test_dqn_refuses_continuous_actions_with_one_line() -> None:
    box = Spaces(gym_spaces.Box(-1, 1, (3,)), gym_spaces.Box(-2, 2, (1,)))
    problem = DQN.space_problem(box)
    assert problem is not None and "continuous" in problem and "\n" not in problem
    assert DQN.space_problem(Spaces(gym_spaces.Box(-1, 1, (4,)), gym_spaces.Discrete(2))) is None


def _validate(*overrides: str) -> None:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        validate(compose("config", overrides=["loop=dqn", *overrides]))


@pytest.mark.parametrize(("overrides", "line"), [
    (["loop.replay.capacity=32", "loop.replay.min_size=0"],
     "loop.replay.capacity: must be at least batch_size (64), got 32"),
    (["loop.replay.samples_per_insert=0"], "loop.replay.samples_per_insert: must be > 0, got 0.0"),
    (["loop.replay.n_step=17"], "loop.replay.n_step: must be in [1, 16]"),
    (["loop.env.id=Pendulum-v1"], "loop.env.id: Pendulum-v1: action space Box("),
    (["loop.hparams.target_every=0"], "loop.hparams.target_every: must be a positive integer, got 0"),
    (["loop.model.kind=transformer"], "loop.model.kind: transformer, but an off-policy loop"),
])
def test_bad_settings_are_one_line_before_launch(overrides: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as failure:
        _validate(*overrides)
    assert line in str(failure.value) and "\n" not in str(failure.value)


def test_the_shipped_defaults_pass_their_checks() -> None:
    _validate("layout=single")
    loop = DQNLoop()
    assert loop.replay.range_errors(loop.hparams.num_steps) == []


def test_an_update_learns_from_the_replay_and_feeds_priorities_back() -> None:
    env = EnvConfig()
    torch.manual_seed(0)
    spaces = probe_spaces(env)
    settings = DQNSettings(num_envs=2, num_steps=16, target_every=2)
    replay = ReplaySettings(capacity=256, batch_size=8, min_size=48, samples_per_insert=1.0,
                            tolerance=8.0, n_step=2, prioritized=True)
    algorithm = DQN(settings, spaces, replay=replay)
    agent = Agent(algorithm.build(), spaces, env)
    worker = RolloutWorker(algorithm, spaces, env, agent, seed=0)
    optimizer = algorithm.optimizer(agent.net)
    assert set(REPLAY_FIGURES) <= set(DQN.losses)
    rows = []
    for update in range(4):
        packed, _ = worker.collect(agent, update)
        info = UpdateInfo(optimizer, torch.Generator().manual_seed(update), 32 * (update + 1),
                          update, 0)
        rows.append(algorithm.update(agent.net, agent.net, [as_segment(worker.segment_format,
                                                                        packed)], info))
    worker.close()
    # The first segment (32) is short of min_size (48): the learner waits; then one sample
    # per insert past min_size, in whole batches of 8, at most the tolerance (8) ahead.
    assert rows[0]["learner_wait"] == 1.0 and rows[0]["learner_steps"] == 0
    assert [r["replay_inserts"] for r in rows] == [32, 64, 96, 128]
    assert all(r["learner_steps"] >= 3 for r in rows[1:])
    assert abs(rows[-1]["replay_samples"] - (128 - 48)) <= 8
    assert rows[-1]["priority_spread"] > 0  # TD errors became priorities
    assert all(torch.isfinite(torch.tensor(r["td_loss"])) for r in rows[1:])
    # The target network is a copy of the online one taken every target_every (2) steps: the
    # same after an even step count, one step behind after an odd one.
    net = agent.net
    same = all(torch.equal(t, q) for t, q in zip(net.target.parameters(), net.q.parameters(),
                                                 strict=True))
    assert same == (algorithm.learner_steps % 2 == 0), algorithm.learner_steps
    assert float(net.epsilon) < 1.0
    state = algorithm.state_dict()
    assert state["replay"]["inserts"] == 128 and state["learner_steps"] == algorithm.learner_steps


def test_collectors_act_epsilon_greedy_and_greedy_is_the_argmax() -> None:
    spaces = Spaces(gym_spaces.Box(-1, 1, (4,)), gym_spaces.Discrete(3))
    algorithm = DQN(DQNSettings(), spaces)
    module = algorithm.build()
    obs = torch.randn(256, 4)
    best = module(obs).argmax(-1)
    assert torch.equal(algorithm.greedy(module, obs), best)
    module.epsilon.fill_(0.0)  # type: ignore[operator]
    actions, _ = algorithm.act(module, obs, torch.Generator().manual_seed(0))
    assert torch.equal(actions, best)
    module.epsilon.fill_(1.0)  # type: ignore[operator]
    actions, _ = algorithm.act(module, obs, torch.Generator().manual_seed(0))
    assert set(actions.tolist()) == {0, 1, 2} and not torch.equal(actions, best)
