"""The runtime's acting modules (app/runtime/models/actor_critic.py) and normalisers (app/runtime/envs/normalize.py)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces as gym_spaces
from gymnasium.wrappers.utils import RunningMeanStd
from gymnasium.wrappers.vector import NormalizeReward
from torch import Tensor, nn
from torch.distributions import Categorical, Normal

from app.runtime.core.algorithm import Spaces
from app.runtime.envs.normalize import ReturnTracker, RunningNorm
from app.runtime.models.actor_critic import (
    ActorCritic,
    action_dtype,
    action_shape,
    obs_shape,
    space_problem,
)

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Multi-threaded reductions may reorder float sums; one thread is bitwise reproducible.
    torch.set_num_threads(1)


def _spaces(env_id: str) -> Spaces:
    env = gym.make(env_id)
    try:
        return Spaces(env.observation_space, env.action_space)
    finally:
        env.close()


def _box(*shape: int) -> gym_spaces.Box:
    return gym_spaces.Box(-1.0, 1.0, shape, np.float32)


IMAGE = gym_spaces.Box(0, 255, (36, 36, 1), np.uint8)


def _reference_init(layer: nn.Linear, std: float = float(np.sqrt(2))) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, 0.0)
    return layer


class _ReferenceActorCritic(nn.Module):
    """The CartPole policy as app/loops/ppo/core.py had it before the runtime (commit 24a6624),
    verbatim but for docstrings: what recorded CartPole runs were made with."""

    def __init__(self, obs_dim: int, num_actions: int, hidden_size: int = 64) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            _reference_init(nn.Linear(obs_dim, hidden_size)),
            nn.Tanh(),
            _reference_init(nn.Linear(hidden_size, hidden_size)),
            nn.Tanh(),
            _reference_init(nn.Linear(hidden_size, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            _reference_init(nn.Linear(obs_dim, hidden_size)),
            nn.Tanh(),
            _reference_init(nn.Linear(hidden_size, hidden_size)),
            nn.Tanh(),
            _reference_init(nn.Linear(hidden_size, num_actions), std=0.01),
        )

    def get_value(self, obs: Tensor) -> Tensor:
        return self.critic(obs).squeeze(-1)

    def get_action_and_value(
        self, obs: Tensor, action: Tensor | None = None, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        dist = Categorical(logits=self.actor(obs), validate_args=False)
        if action is None:
            action = torch.multinomial(dist.probs, 1, generator=generator).squeeze(-1)
        return action, dist.log_prob(action), dist.entropy(), self.get_value(obs)

    def forward(self, obs: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        _, logprob, entropy, value = self.get_action_and_value(obs, action)
        return logprob, entropy, value


# --- models: CartPole is exactly the pre-runtime ActorCritic ------------------------------------


def test_cartpole_module_is_todays_actor_critic() -> None:
    spaces = _spaces("CartPole-v1")
    torch.manual_seed(7)
    new = ActorCritic.from_spaces(spaces, 64)
    after_new = torch.rand(3)  # the global RNG after construction: the same draws were taken
    torch.manual_seed(7)
    old = _ReferenceActorCritic(4, 2, 64)
    after_old = torch.rand(3)
    assert torch.equal(after_new, after_old)

    new_state, old_state = new.state_dict(), old.state_dict()
    assert list(new_state) == list(old_state)
    assert list(new_state)[:2] == ["critic.0.weight", "critic.0.bias"]
    for name, tensor in old_state.items():
        assert torch.equal(new_state[name], tensor), name

    obs = torch.randn(16, 4)
    with torch.no_grad():
        action, logprob, value = new.act(obs, torch.Generator().manual_seed(3))
        old_action, old_logprob, _, old_value = old.get_action_and_value(
            obs, generator=torch.Generator().manual_seed(3))
        assert torch.equal(action, old_action) and action.dtype == torch.int64
        assert torch.equal(logprob, old_logprob)
        assert torch.equal(value, old_value)
        assert torch.equal(new.value(obs), old.get_value(obs))

    actions = torch.randint(0, 2, (16,))
    for got, want in zip(new(obs, actions), old(obs, actions), strict=True):
        assert torch.equal(got, want)


def test_sampling_uses_only_the_generator() -> None:
    for spaces, obs in ((_spaces("CartPole-v1"), torch.randn(8, 4)),
                        (Spaces(_box(5), _box(2)), torch.randn(8, 5))):
        torch.manual_seed(0)
        module = ActorCritic.from_spaces(spaces, 32)
        state = torch.get_rng_state()
        first = module.act(obs, torch.Generator().manual_seed(11))[0]
        assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not touched
        second = module.act(obs, torch.Generator().manual_seed(11))[0]
        assert torch.equal(first, second)


# --- models: Gaussian policies ------------------------------------------------------------------


def test_gaussian_logprob_and_entropy_are_normals_summed_over_action_dims() -> None:
    torch.manual_seed(1)
    module = ActorCritic.from_spaces(Spaces(_box(6), _box(2, 3)), 16)
    assert module.actor_logstd.shape == (1, 6)
    assert torch.equal(module.actor_logstd, torch.zeros(1, 6))  # CleanRL's start: std 1
    with torch.no_grad():
        module.actor_logstd.copy_(torch.linspace(-1.0, 0.5, 6))
    obs = torch.randn(10, 6)
    with torch.no_grad():
        action, logprob, _ = module.act(obs, torch.Generator().manual_seed(2))
        assert action.shape == (10, 2, 3) and action.dtype == torch.float32
        normal = Normal(module.actor(obs), module.actor_logstd.exp().expand(10, 6))
        want = normal.log_prob(action.reshape(10, 6)).sum(-1)
        torch.testing.assert_close(logprob, want)
        got_logprob, entropy, _ = module.evaluate(obs, action)
        torch.testing.assert_close(got_logprob, want)
        torch.testing.assert_close(entropy, normal.entropy().sum(-1))


def test_gaussian_actions_are_unclipped_samples_around_the_mean() -> None:
    torch.manual_seed(0)
    module = ActorCritic.from_spaces(Spaces(_box(3), gym_spaces.Box(-0.1, 0.1, (1,))), 8)
    obs = torch.zeros(4000, 3)
    with torch.no_grad():
        action = module.act(obs, torch.Generator().manual_seed(0))[0]
        mean = module.actor(obs[:1])
    # std starts at 1: samples leave the space's [-0.1, 0.1] (the runtime clips, not the module)
    assert action.abs().max() > 1.0
    assert abs(float(action.mean() - mean.mean())) < 0.1
    assert abs(float(action.std()) - 1.0) < 0.1


def test_gradients_flow_through_actor_logstd() -> None:
    torch.manual_seed(0)
    module = ActorCritic.from_spaces(_spaces("Pendulum-v1"), 16)
    obs = torch.randn(5, 3)
    with torch.no_grad():
        action = module.act(obs, torch.Generator().manual_seed(0))[0]
    logprob, entropy, value = module(obs, action)
    (logprob.mean() + entropy.mean() + value.mean()).backward()
    assert module.actor_logstd.grad is not None
    assert module.actor_logstd.grad.abs().sum() > 0
    assert all(p.grad is not None for p in module.parameters())


# --- models: shapes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spaces", "obs_dims", "act_dims", "act_dtype"),
    [
        (_spaces("Pendulum-v1"), (3,), (1,), torch.float32),
        (Spaces(_box(11), _box(3)), (11,), (3,), torch.float32),  # a MuJoCo-like Box(3)
        (Spaces(IMAGE, gym_spaces.Discrete(4)), (36, 36, 1), (), torch.int64),
        (Spaces(IMAGE, _box(2)), (36, 36, 1), (2,), torch.float32),
        (Spaces(gym_spaces.Box(-1.0, 1.0, ()), gym_spaces.Discrete(3)), (), (), torch.int64),
    ],
    ids=["pendulum", "box3", "image-discrete", "image-box", "scalar-obs"],
)
def test_shapes(
    spaces: Spaces, obs_dims: tuple[int, ...], act_dims: tuple[int, ...], act_dtype: torch.dtype
) -> None:
    assert space_problem(spaces) is None
    assert obs_shape(spaces) == obs_dims
    assert action_shape(spaces) == act_dims
    assert action_dtype(spaces) == act_dtype
    torch.manual_seed(0)
    module = ActorCritic.from_spaces(spaces, 32)
    sample = np.stack([spaces.observation.sample() for _ in range(6)])
    obs = torch.as_tensor(sample)
    with torch.no_grad():
        action, logprob, value = module.act(obs, torch.Generator().manual_seed(0))
        assert action.shape == (6, *act_dims) and action.dtype == act_dtype
        assert logprob.shape == (6,) and value.shape == (6,)
        assert torch.equal(module.value(obs), value)
        # The training path takes any leading dims, e.g. a segment's [T, N].
        seq_obs = obs.reshape(2, 3, *obs_dims)
        seq_action = action.reshape(2, 3, *act_dims)
        got = module.evaluate(seq_obs, seq_action)
        assert all(t.shape == (2, 3) for t in got)
        torch.testing.assert_close(got[0].reshape(6), logprob)
        torch.testing.assert_close(got[2].reshape(6), value)


def test_image_module_is_the_nature_cnn_and_takes_float_pixels() -> None:
    torch.manual_seed(0)
    module = ActorCritic.from_spaces(Spaces(gym_spaces.Box(0, 255, (84, 84, 4), np.uint8),
                                            gym_spaces.Discrete(6)), 64)
    convs = [m for m in module.torso if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride) for c in convs] == [
        (32, (8, 8), (4, 4)), (64, (4, 4), (2, 2)), (64, (3, 3), (1, 1))]
    assert convs[0].in_channels == 4
    linear = [m for m in module.torso if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(64 * 7 * 7, 512)]
    pixels = torch.randint(0, 256, (3, 84, 84, 4), dtype=torch.uint8)
    with torch.no_grad():
        torch.testing.assert_close(module.value(pixels), module.value(pixels.float()))


def test_construction_is_deterministic_under_a_seed() -> None:
    states = []
    for _ in range(2):
        torch.manual_seed(5)
        states.append(ActorCritic.from_spaces(Spaces(IMAGE, _box(2)), 16).state_dict())
    assert list(states[0]) == list(states[1])
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


# --- models: unsupported spaces -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spaces", "starts"),
    [
        (Spaces(gym_spaces.Dict({"pos": _box(2)}), gym_spaces.Discrete(2)),
         "observation space Dict("),
        (Spaces(_box(4), gym_spaces.MultiDiscrete([2, 3])), "action space MultiDiscrete("),
        (Spaces(_box(4), gym_spaces.Tuple((gym_spaces.Discrete(2),))), "action space Tuple("),
        (Spaces(_box(4, 4), gym_spaces.Discrete(2)), "observation space Box("),
        (Spaces(gym_spaces.Box(0.0, 1.0, (36, 36, 3)), gym_spaces.Discrete(2)),
         "observation space Box("),
        (Spaces(gym_spaces.Box(0, 255, (8, 8, 3), np.uint8), gym_spaces.Discrete(2)),
         "observation space Box("),
    ],
    ids=["dict-obs", "multidiscrete-action", "tuple-action", "2d-box-obs", "float-image",
         "tiny-image"],
)
def test_space_problem(spaces: Spaces, starts: str) -> None:
    problem = space_problem(spaces)
    assert problem is not None and problem.startswith(starts)
    assert "\n" not in problem
    with pytest.raises(ValueError, match="not supported|too small"):
        ActorCritic.from_spaces(spaces, 8)


def test_space_problem_names_what_is_supported() -> None:
    problem = space_problem(Spaces(gym_spaces.Dict({"a": _box(1)}), gym_spaces.Discrete(2)))
    assert problem is not None and "supported: Box vectors, HxWxC uint8 images" in problem
    assert space_problem(_spaces("CartPole-v1")) is None


# --- normalize: RunningNorm ---------------------------------------------------------------------


@pytest.mark.parametrize("cuts", [[], [1], [37, 38, 90], list(range(1, 100))])
def test_merged_moments_equal_the_whole_datas_mean_and_var(cuts: list[int]) -> None:
    data = np.random.default_rng(0).normal(3.0, 2.0, (100, 4))
    norm = RunningNorm((4,), epsilon=0.0)  # no prior count: exactly the data's statistics
    parts = np.split(data, cuts)
    for part in parts:
        norm.merge(RunningNorm.batch_moments(torch.as_tensor(part), (4,)))
    np.testing.assert_allclose(norm.mean.numpy(), data.mean(0), rtol=1e-12)
    np.testing.assert_allclose(norm.var.numpy(), data.var(0), rtol=1e-12)
    assert float(norm.count) == 100

    together = RunningNorm((4,), epsilon=0.0)  # the same parts merged at once, [K, size]
    together.merge(torch.stack([RunningNorm.batch_moments(torch.as_tensor(p), (4,))
                                for p in parts]))
    np.testing.assert_allclose(together.mean.numpy(), data.mean(0), rtol=1e-12)
    np.testing.assert_allclose(together.var.numpy(), data.var(0), rtol=1e-12)


def test_merge_matches_gymnasiums_running_mean_std() -> None:
    rng = np.random.default_rng(1)
    reference, norm = RunningMeanStd(shape=(3,)), RunningNorm((3,))
    for size in (5, 1, 17, 64):
        batch = rng.normal(-1.0, 4.0, (size, 3))
        reference.update(batch)
        norm.merge(RunningNorm.batch_moments(torch.as_tensor(batch), (3,)))
    np.testing.assert_allclose(norm.mean.numpy(), reference.mean, rtol=1e-10)
    np.testing.assert_allclose(norm.var.numpy(), reference.var, rtol=1e-10)
    np.testing.assert_allclose(float(norm.count), reference.count, rtol=1e-12)


def test_batch_moments_flatten_leading_dims_and_empty_batches_merge_as_nothing() -> None:
    x = torch.randn(5, 3, 2, dtype=torch.float64)  # [T, N, obs]
    assert RunningNorm.moments_size((2,)) == 5
    torch.testing.assert_close(RunningNorm.batch_moments(x, (2,)),
                               RunningNorm.batch_moments(x.reshape(15, 2), (2,)))
    assert RunningNorm.batch_moments(x).shape == (RunningNorm.moments_size(()),)
    norm = RunningNorm((2,))
    before = {k: v.clone() for k, v in norm.state_dict().items()}
    norm.merge(RunningNorm.batch_moments(torch.zeros(0, 2), (2,)))
    assert all(torch.equal(before[k], v) for k, v in norm.state_dict().items())
    with pytest.raises(ValueError, match="moments of 3 elements"):
        norm.merge(RunningNorm.batch_moments(torch.zeros(4)))


def test_normalize_and_clip() -> None:
    norm = RunningNorm((2,), epsilon=0.0)
    data = torch.tensor([[0.0, 10.0], [2.0, 30.0], [4.0, 20.0]], dtype=torch.float64)
    norm.merge(RunningNorm.batch_moments(data, (2,)))
    x = torch.tensor([[2.0, 20.0], [6.0, 0.0], [-100.0, 1000.0]])
    out = norm.normalize(x, clip=5.0)
    assert out.dtype == torch.float32 and out.shape == (3, 2)
    want = (x.double().numpy() - data.numpy().mean(0)) / np.sqrt(data.numpy().var(0) + 1e-8)
    np.testing.assert_allclose(out.numpy(), np.clip(want, -5.0, 5.0), rtol=1e-6)
    assert float(out.max()) == 5.0 and float(out.min()) == -5.0  # the clip bit


def test_scale_divides_by_the_return_std_and_clips() -> None:
    norm = RunningNorm(())
    norm.merge(RunningNorm.batch_moments(torch.tensor([1.0, 5.0, -3.0, 9.0])))
    rewards = torch.tensor([0.5, -2.0, 100.0])
    out = norm.scale(rewards, clip=3.0)
    assert out.dtype == torch.float32
    want = rewards.double() / torch.sqrt(norm.var + 1e-8)
    torch.testing.assert_close(out, want.clamp(-3.0, 3.0).float())
    assert float(out[2]) == 3.0
    with pytest.raises(ValueError, match="scalar"):
        RunningNorm((2,)).scale(rewards, 1.0)


def test_statistics_are_float64_buffers_updated_in_place() -> None:
    norm = RunningNorm((3,))
    assert set(norm.state_dict()) == {"mean", "var", "count"}
    assert all(t.dtype == torch.float64 for t in norm.state_dict().values())
    assert float(norm.count) == pytest.approx(1e-4) and torch.equal(norm.var, torch.ones(3))
    tensors = dict(norm.named_buffers())
    pointers = {k: v.data_ptr() for k, v in tensors.items()}
    norm.merge(RunningNorm.batch_moments(torch.randn(10, 3), (3,)))
    norm.merge(torch.stack([RunningNorm.batch_moments(torch.randn(4, 3), (3,))] * 2))
    for name, tensor in norm.named_buffers():
        assert tensor is tensors[name] and tensor.data_ptr() == pointers[name]
    assert float(norm.count) > 17  # and they did change


# --- normalize: ReturnTracker against gymnasium's NormalizeReward -------------------------------


class _RewardStream(gym.Env[np.ndarray, np.int64]):
    """Random rewards, random terminations and a time limit of 7 steps (so both kinds of end)."""

    def __init__(self) -> None:
        self.observation_space = gym_spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.action_space = gym_spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        reward = float(self.np_random.normal(1.0, 3.0))
        terminated = bool(self.np_random.random() < 0.1)
        return np.zeros(1, np.float32), reward, terminated, self.t >= 7, {}


def test_return_tracker_matches_gymnasiums_normalize_reward() -> None:
    num_envs, gamma = 4, 0.9

    def make() -> gym.vector.VectorEnv:
        return gym.vector.SyncVectorEnv([_RewardStream for _ in range(num_envs)],
                                        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)

    # The same seeds twice: ``raw`` yields the rewards the wrapper scales.
    wrapped, raw_envs = NormalizeReward(make(), gamma=gamma), make()
    wrapped.reset(seed=0)
    raw_envs.reset(seed=0)
    tracker, norm = ReturnTracker(num_envs, gamma), RunningNorm(())
    ends = {"terminated": 0, "truncated": 0}
    for _ in range(200):
        actions = np.zeros(num_envs, np.int64)
        _, scaled, term, trunc, _ = wrapped.step(actions)
        _, raw_reward, raw_term, _, _ = raw_envs.step(actions)
        assert np.array_equal(term, raw_term)
        raw = torch.as_tensor(raw_reward, dtype=torch.float32)
        # The trainer's merge after every step: the rollout scales with the statistics that
        # include this step's returns, as the wrapper does.
        tracker.step(raw, torch.as_tensor(term), torch.as_tensor(trunc))
        norm.merge(tracker.take_moments())
        ours = norm.scale(raw, clip=1e9)
        np.testing.assert_allclose(ours.numpy(), scaled, rtol=1e-5, atol=1e-6)
        ends["terminated"] += int(term.sum())
        ends["truncated"] += int((trunc & ~term).sum())
    assert ends["terminated"] > 0 and ends["truncated"] > 0  # both resets were exercised
    np.testing.assert_allclose(float(norm.var), wrapped.return_rms.var, rtol=1e-5)
    wrapped.close()
    raw_envs.close()


def test_return_tracker_moments_cover_every_step_since_the_last_take() -> None:
    tracker = ReturnTracker(2, gamma=0.5)
    no_end = torch.zeros(2)
    tracker.step(torch.tensor([1.0, 2.0]), no_end)
    tracker.step(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))  # env 1 terminates
    tracker.step(torch.tensor([4.0, 3.0]), no_end)
    # returns: [1, 2], [1.5, 0 (terminated: gamma*(1-1))], [4.75, 3 (restarted)]
    seen = torch.tensor([1.0, 2.0, 1.5, 0.0, 4.75, 3.0], dtype=torch.float64)
    torch.testing.assert_close(tracker.take_moments(), RunningNorm.batch_moments(seen))
    assert torch.equal(tracker.take_moments(), torch.zeros(3))  # nothing since the last take
