"""SAC's pieces against the paper's formulas (Haarnoja et al. 2018, "Soft Actor-Critic
Algorithms and Applications"), on hand-made tensors: the soft Q target, the tanh
change-of-variables log-prob, the actor and alpha losses, Polyak averaging, the actions' bounds,
the delayed actor steps, the checkpointed target networks and entropy coefficient, and the
settings' checks before launch."""

from __future__ import annotations

import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from app.errors import ConfigError
from app.launch.planning import validate
from app.loops.sac import (
    SAC,
    SACLoop,
    SACSettings,
    actor_loss,
    alpha_loss,
    sac_replay,
    soft_q_targets,
    squashed_log_prob,
)
from app.runtime.checkpoints.checkpoint import (
    TrainingState,
    newest_valid_checkpoint,
    save_checkpoint,
)
from app.runtime.core.algorithm import Segment, Spaces, UpdateInfo
from app.runtime.replay.buffer import Batch, ReplaySettings
from app.runtime.replay.offpolicy import soft_update
from tests.helpers.apprun import REPO

pytestmark = pytest.mark.unit


def _spaces(low: float = -2.0, high: float = 2.0, act_dim: int = 1) -> Spaces:
    return Spaces(observation=gym.spaces.Box(-1, 1, (3,), np.float32),
                  action=gym.spaces.Box(low, high, (act_dim,), np.float32))


def test_soft_q_target_is_reward_plus_discounted_soft_value() -> None:
    rewards = torch.tensor([1.0, -0.5, 2.0])
    discounts = torch.tensor([0.99, 0.99**3, 0.0])  # 1-step, 3-step, episode ended
    q1, q2 = torch.tensor([3.0, 1.0, 9.0]), torch.tensor([2.5, 4.0, 9.0])
    log_pi, alpha = torch.tensor([-1.0, 0.5, 7.0]), 0.2
    want = [1.0 + 0.99 * (2.5 - 0.2 * -1.0), -0.5 + 0.99**3 * (1.0 - 0.2 * 0.5), 2.0]
    got = soft_q_targets(rewards, discounts, q1, q2, log_pi, alpha)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_squashed_log_prob_is_the_density_of_the_scaled_tanh() -> None:
    # a = b + s tanh(u): p(a) = N(u) / prod_i s_i (1 - tanh(u_i)^2), checked by the density of
    # a 1-d action against a numeric derivative of the inverse map.
    mean, std, scale = torch.tensor([[0.3]]), torch.tensor([[0.7]]), torch.tensor([2.0])
    normal = torch.distributions.Normal(mean, std)
    u = torch.tensor([[0.4]], dtype=torch.float64)
    got = squashed_log_prob(torch.distributions.Normal(mean.double(), std.double()), u,
                            scale.double())
    a, h = float(scale * math.tanh(0.4)), 1e-6
    inverse = lambda x: math.atanh(x / 2.0)  # noqa: E731
    du_da = (inverse(a + h) - inverse(a - h)) / (2 * h)
    want = float(normal.log_prob(torch.tensor([[0.4]]))) + math.log(du_da)
    assert float(got) == pytest.approx(want, abs=1e-4)
    assert got.shape == (1,)


def test_squashed_log_prob_sums_over_action_dimensions() -> None:
    mean, std = torch.zeros(2, 3), torch.ones(2, 3)
    u = torch.tensor([[0.1, -0.2, 0.3], [1.0, 0.0, -1.5]])
    scale = torch.tensor([1.0, 0.5, 3.0])
    got = squashed_log_prob(torch.distributions.Normal(mean, std), u, scale)
    per_dim = (-0.5 * u**2 - 0.5 * math.log(2 * math.pi)
               - torch.log(scale * (1 - torch.tanh(u) ** 2) + 1e-6))
    torch.testing.assert_close(got, per_dim.sum(-1), rtol=1e-5, atol=1e-5)


def test_actor_loss_is_alpha_log_pi_minus_the_smaller_q() -> None:
    log_pi = torch.tensor([-1.0, 2.0])
    q1, q2 = torch.tensor([5.0, -1.0]), torch.tensor([4.0, 3.0])
    want = ((0.1 * -1.0 - 4.0) + (0.1 * 2.0 - -1.0)) / 2
    assert float(actor_loss(log_pi, q1, q2, 0.1)) == pytest.approx(want, rel=1e-6)


def test_alpha_loss_raises_alpha_below_the_target_entropy_and_lowers_it_above() -> None:
    target = -1.0  # -|A| for one action dimension
    for log_pi, sign in ((torch.tensor([2.0, 3.0]), -1.0), (torch.tensor([-4.0, -3.0]), 1.0)):
        log_alpha = torch.tensor(math.log(0.2), requires_grad=True)
        loss = alpha_loss(log_alpha, log_pi, target)
        assert float(loss.detach()) == pytest.approx(float((-0.2 * (log_pi + target)).mean()), rel=1e-6)
        loss.backward()
        assert log_alpha.grad is not None
        # Entropy (-log pi) under the target: the gradient is negative, so a descent step raises
        # alpha; over it, the reverse.
        assert math.copysign(1.0, float(log_alpha.grad)) == sign


def test_polyak_update_moves_the_target_by_tau() -> None:
    source, target = nn.Linear(2, 2), nn.Linear(2, 2)
    before = [p.detach().clone() for p in target.parameters()]
    soft_update(target, source, 0.005)
    for t, b, s in zip(target.parameters(), before, source.parameters(), strict=True):
        torch.testing.assert_close(t, 0.005 * s + 0.995 * b, rtol=1e-6, atol=1e-7)


def test_actions_stay_in_the_box_greedy_is_the_scaled_tanh_of_the_mean() -> None:
    torch.manual_seed(0)
    sac = SAC(SACSettings(hidden_sizes=[8]), _spaces(-3.0, 1.0, 2))
    net = sac.build()
    obs, gen = torch.randn(64, 3), torch.Generator().manual_seed(0)
    with torch.no_grad():
        uniform = sac.act(net, obs, gen)[0]
        net.uniform.fill_(0.0)  # type: ignore[operator]
        sampled = sac.act(net, obs, gen)[0]
        mean = net.actor.gaussian(obs)[0]  # type: ignore[operator, union-attr]
        greedy = sac.greedy(net, obs)
    for actions in (uniform, sampled, greedy):
        assert actions.shape == (64, 2)
        assert bool((actions >= -3.0).all()) and bool((actions <= 1.0).all())
    torch.testing.assert_close(greedy, -1.0 + 2.0 * torch.tanh(mean))
    assert not torch.allclose(sampled, greedy)  # exploration samples
    assert float(uniform.std()) > 0.8  # uniform over a width of 4: std 4/sqrt(12) ~ 1.15


def test_defaults_are_cleanrl_sac_continuous_actions() -> None:
    s, r = SACSettings(), sac_replay()
    assert (s.q_lr, s.policy_lr, s.gamma, s.tau, s.policy_frequency) == (1e-3, 3e-4, 0.99,
                                                                          0.005, 2)
    assert s.hidden_sizes == [256, 256] and s.autotune
    assert (r.capacity, r.batch_size, r.min_size, r.n_step) == (1_000_000, 256, 5_000, 1)
    assert SAC(s, _spaces(act_dim=3)).target_entropy == -3.0


def test_space_problem_refuses_discrete_actions() -> None:
    problem = SAC.space_problem(Spaces(observation=gym.spaces.Box(-1, 1, (4,), np.float32),
                                       action=gym.spaces.Discrete(2)))
    assert problem is not None and "discrete" in problem and "\n" not in problem
    assert SAC.space_problem(_spaces()) is None


def _batch(n: int = 32) -> Batch:
    g = torch.Generator().manual_seed(1)
    return Batch(obs=torch.randn(n, 3, generator=g), actions=torch.rand(n, 1, generator=g),
                 rewards=torch.randn(n, generator=g), next_obs=torch.randn(n, 3, generator=g),
                 discounts=torch.full((n,), 0.99), weights=torch.ones(n),
                 indices=torch.arange(n), extras={})


def test_learn_steps_q_every_time_and_actor_alpha_every_second_step() -> None:
    torch.manual_seed(0)
    sac = SAC(SACSettings(hidden_sizes=[16]), _spaces())
    net: nn.Module = sac.build()
    opt = sac.optimizer(net)
    info = UpdateInfo(optimizer=opt, generator=torch.Generator().manual_seed(0), env_steps=0,
                      update=0, lag=0)
    snap = lambda m: [p.detach().clone() for p in m.parameters()]  # noqa: E731
    moved = lambda a, b: any(not torch.equal(x, y) for x, y in zip(a, b, strict=True))  # noqa: E731
    for step in range(4):
        actor, q1, target, alpha = snap(net.actor), snap(net.q1), snap(net.q1_target), sac.log_alpha.item()
        figures, priorities = sac.learn(net, net, _batch(), info)
        sac.learner_steps += 1  # the base's update counts learner steps
        assert moved(q1, snap(net.q1)) and moved(target, snap(net.q1_target))
        assert moved(actor, snap(net.actor)) == (step % 2 == 0)
        assert (sac.log_alpha.item() != alpha) == (step % 2 == 0)
        assert float(net.log_alpha) == sac.log_alpha.item()  # the collectors' copy
        assert priorities is not None and priorities.shape == (32,)
        assert math.isfinite(figures["q_loss"]) and math.isfinite(figures["actor_loss"])
    assert float(net.uniform) == 0.0  # learning started: collectors sample the actor


def test_state_dict_round_trips_log_alpha_and_its_optimizer() -> None:
    torch.manual_seed(0)
    sac = SAC(SACSettings(hidden_sizes=[16]), _spaces())
    net = sac.build()
    info = UpdateInfo(optimizer=sac.optimizer(net), generator=torch.Generator().manual_seed(0),
                      env_steps=0, update=0, lag=0)
    sac.learn(net, net, _batch(), info)
    state = sac.state_dict()
    fresh = SAC(SACSettings(hidden_sizes=[16]), _spaces())
    fresh.load_state_dict(state)
    assert fresh.log_alpha.item() == pytest.approx(sac.log_alpha.item())
    moments = fresh.alpha_optimizer.state_dict()["state"][0]["exp_avg"]
    torch.testing.assert_close(moments, sac.alpha_optimizer.state_dict()["state"][0]["exp_avg"])


def _validate(*overrides: str) -> None:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        validate(compose("config", overrides=["loop=sac", *overrides]))


@pytest.mark.parametrize(("overrides", "line"), [
    (["loop.hparams.tau=0"], "loop.hparams.tau: must be in (0, 1], got 0.0"),
    (["loop.hparams.policy_frequency=0"],
     "loop.hparams.policy_frequency: must be a positive integer, got 0"),
    (["loop.hparams.q_lr=-1"], "loop.hparams.q_lr: must be > 0, got -1.0"),
    (["loop.hparams.hidden_sizes=[]"], "loop.hparams.hidden_sizes: must be one or more positive"),
    (["loop.replay.capacity=100"], "loop.replay.capacity: must be at least batch_size (256)"),
    (["loop.env.id=CartPole-v1"], "loop.env.id: CartPole-v1: action space Discrete(2) is discrete"),
])
def test_bad_settings_are_one_line_before_launch(overrides: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as failure:
        _validate(*overrides)
    assert line in str(failure.value) and "\n" not in str(failure.value)


def test_the_shipped_defaults_and_hopper_sac_pass_their_checks() -> None:
    _validate("layout=single")
    _validate("+experiment=hopper_sac")
    loop = SACLoop()
    assert loop.replay.range_errors(loop.hparams.num_steps) == []


def test_a_checkpoint_keeps_the_targets_log_alpha_and_its_adam(tmp_path: Path) -> None:
    torch.manual_seed(0)
    replay = ReplaySettings(capacity=64, batch_size=8, min_size=16, samples_per_insert=1.0,
                            tolerance=8.0)
    sac = SAC(SACSettings(num_envs=4, num_steps=4, hidden_sizes=[16]), _spaces(), replay=replay)
    module = sac.build()
    opt = sac.optimizer(module)
    for update in range(4):
        segment = Segment(obs=torch.randn(4, 4, 3), actions=torch.rand(4, 4, 1) * 4 - 2,
                          rewards=torch.randn(4, 4), dones=torch.zeros(4, 4),
                          next_obs=torch.randn(4, 3), next_done=torch.zeros(4))
        info = UpdateInfo(opt, torch.Generator().manual_seed(update), 16 * (update + 1), update, 0)
        sac.update(module, module, [segment], info)
    assert sac.learner_steps > 0 and sac.log_alpha.item() != 0.0  # alpha moved from 1
    save_checkpoint(tmp_path, module, opt,
                    TrainingState(update=4, env_steps=64, algorithm=sac.state_dict()))
    state = newest_valid_checkpoint(tmp_path).state

    resumed = SAC(SACSettings(num_envs=4, num_steps=4, hidden_sizes=[16]), _spaces(),
                  replay=replay)
    fresh = resumed.build()
    fresh.load_state_dict(state["policy"])
    resumed.load_state_dict(state["algorithm"])
    assert resumed.log_alpha.item() == sac.log_alpha.item()
    assert resumed.learner_steps == sac.learner_steps
    torch.testing.assert_close(resumed.alpha_optimizer.state_dict()["state"],
                               sac.alpha_optimizer.state_dict()["state"])
    for name in ("q1_target", "q2_target"):
        for a, b in zip(getattr(fresh, name).parameters(), getattr(module, name).parameters(),
                        strict=True):
            torch.testing.assert_close(a, b)
            assert not a.requires_grad
