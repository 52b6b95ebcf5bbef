"""The transformer policy (app/runtime/models/transformer.py) and its tensor-parallel plan, the
observation windows it reads (app/runtime/envs/history.py) and the memory task
(app/runtime/envs/memory.py), in this process. The plan on two real gloo ranks is
tests/integration/test_transformer.py."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces as gym_spaces
from gymnasium.vector import AutoresetMode
from torch import Tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributions import Normal

from app.runtime.core.algorithm import Spaces
from app.runtime.envs.history import ObsHistory
from app.runtime.envs.memory import (
    MASKED_CARTPOLE_ID,
    masked_cartpole,
    register_memory_envs,
)
from app.runtime.models.transformer import (
    TransformerActorCritic,
    check_tensor_parallel,
    ffn_hidden,
    transformer_space_problem,
)
from app.runtime.models.transformer_tp import tensor_parallel_plan
from tests.helpers.transformer_inputs import (
    BOX,
    CONTEXT,
    DISCRETE,
    HEADS,
    OBS_DIM,
    WIDTH,
    make_model,
    policy_loss,
    random_actions,
    random_windows,
)


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    torch.set_num_threads(1)


# --- the policy ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_space_problem_takes_vectors_and_actionable_spaces_only() -> None:
    assert transformer_space_problem(DISCRETE) is None
    assert transformer_space_problem(BOX) is None
    image = gym_spaces.Box(0, 255, (36, 36, 1), np.uint8)
    for obs in (image, gym_spaces.Box(-1.0, 1.0, (2, 3)), gym_spaces.Box(-1.0, 1.0, ()),
                gym_spaces.Discrete(4), gym_spaces.Dict({"a": DISCRETE.observation})):
        problem = transformer_space_problem(Spaces(obs, gym_spaces.Discrete(2)))
        assert problem is not None and "\n" not in problem
        assert problem.startswith(f"observation space {obs} is not supported")
        assert "1-D Box" in problem
    problem = transformer_space_problem(Spaces(DISCRETE.observation, gym_spaces.Discrete(2, start=1)))
    assert problem is not None and "must start at 0" in problem
    with pytest.raises(ValueError, match="is not supported"):
        TransformerActorCritic(Spaces(image, gym_spaces.Discrete(2)), WIDTH, 1, HEADS, CONTEXT)
    with pytest.raises(ValueError, match="width 16 is not divisible by heads 3"):
        TransformerActorCritic(DISCRETE, WIDTH, 1, 3, CONTEXT)


@pytest.mark.unit
def test_structure_is_named_as_torchtitans_llama() -> None:
    torch.manual_seed(0)
    model = make_model(DISCRETE)
    assert model.history_shape == (CONTEXT, OBS_DIM + 1)
    assert model.embed.in_features == OBS_DIM + 1 and model.pos.table.shape == (CONTEXT, WIDTH)
    assert len(model.layers) == 2 and model.hidden == ffn_hidden(WIDTH)
    names = {name for name, _ in model.named_modules()}
    for sub in ("attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo",
                "ffn_norm", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
        assert f"layers.1.{sub}" in names
    assert model.actor.out_features == 3 and model.critic.out_features == 1
    assert not hasattr(model, "actor_std")
    box = make_model(BOX)
    assert box.actor.out_features == 4
    assert torch.equal(box.actor_std.log_std, torch.zeros(1, 4))  # CleanRL's start: std 1


@pytest.mark.unit
def test_init_is_a_function_of_the_global_seed() -> None:
    torch.manual_seed(5)
    first = make_model(BOX).state_dict()
    torch.manual_seed(5)
    second = make_model(BOX).state_dict()
    assert list(first) == list(second)
    assert all(torch.equal(first[name], second[name]) for name in first)
    torch.manual_seed(6)
    assert not torch.equal(make_model(BOX).state_dict()["layers.0.attention.wq.weight"],
                           first["layers.0.attention.wq.weight"])


@pytest.mark.unit
def test_methods_match_actor_critics_shapes_and_dtypes() -> None:
    for spaces, action_dims in ((DISCRETE, ()), (BOX, (2, 2))):
        torch.manual_seed(0)
        model = make_model(spaces)
        obs = random_windows(5, 3)  # [T, N, context, obs_dim + 1], as a segment holds them
        actions = random_actions(spaces, 5, 3)
        with torch.no_grad():
            action, logprob, value = model.act(obs[0], torch.Generator().manual_seed(1))
            assert action.shape == (3, *action_dims) and logprob.shape == value.shape == (3,)
            assert action.dtype == (torch.int64 if spaces is DISCRETE else torch.float32)
            assert model.value(obs).shape == (5, 3)
            outputs = model.evaluate(obs, actions)
            assert all(out.shape == (5, 3) for out in outputs)
            for got, want in zip(model(obs, actions), outputs, strict=True):
                assert torch.equal(got, want)
            # Batched or not, each window gets the same numbers.
            torch.testing.assert_close(model.value(obs[0, 0]), value[0])
            torch.testing.assert_close(model.evaluate(obs[0], action)[0], logprob)
        with pytest.raises(ValueError, match=r"observations must be \[\*B, 4, 4\]"):
            model.value(torch.zeros(3, CONTEXT + 1, OBS_DIM + 1))


@pytest.mark.unit
def test_sampling_uses_only_the_generator() -> None:
    for spaces in (DISCRETE, BOX):
        torch.manual_seed(0)
        model = make_model(spaces)
        obs = random_windows(64)
        state = torch.get_rng_state()
        with torch.no_grad():
            first = model.act(obs, torch.Generator().manual_seed(11))[0]
            assert torch.equal(torch.get_rng_state(), state)
            assert torch.equal(first, model.act(obs, torch.Generator().manual_seed(11))[0])
            assert not torch.equal(first, model.act(obs, torch.Generator().manual_seed(12))[0])


@pytest.mark.unit
def test_gaussian_is_normal_summed_over_action_dims_and_unclipped() -> None:
    torch.manual_seed(1)
    model = make_model(BOX)
    with torch.no_grad():
        log_std = model.actor_std.log_std
        log_std.copy_(torch.linspace(-1.0, 0.5, 4))
        obs = random_windows(2000)
        action, logprob, _ = model.act(obs, torch.Generator().manual_seed(2))
        mean = model.actor(model._features(obs))
        normal = Normal(mean, log_std.exp().expand_as(mean))
        torch.testing.assert_close(logprob, normal.log_prob(action.reshape(-1, 4)).sum(-1))
        got_logprob, entropy, _ = model.evaluate(obs, action)
        torch.testing.assert_close(got_logprob, logprob)
        torch.testing.assert_close(entropy, normal.entropy().sum(-1))
        assert action.abs().max() > 1.0  # the space is [-1, 1]: the runtime clips, not the model
    loss = policy_loss(model.evaluate(obs[:8], action[:8]))
    loss.backward()
    assert log_std.grad is not None and log_std.grad.abs().sum() > 0


@pytest.mark.unit
def test_padding_is_never_attended_and_valid_steps_are() -> None:
    torch.manual_seed(0)
    model = make_model(DISCRETE)
    obs = random_windows(32, seed=3)
    obs[0, :, -1] = 0.0  # one window with only its newest step real (the flag is forced there)
    obs[0, -1, -1] = 1.0
    padding = obs[..., -1:] == 0
    noisy = torch.where(padding, torch.randn_like(obs) * 10, obs)
    noisy[..., -1] = obs[..., -1]  # the flags stay: only what padding holds changes
    actions = random_actions(DISCRETE, 32)
    with torch.no_grad():
        clean_out, noisy_out = model.evaluate(obs, actions), model.evaluate(noisy, actions)
        for clean, dirty in zip(clean_out, noisy_out, strict=True):
            assert torch.isfinite(clean).all()
            torch.testing.assert_close(clean, dirty, rtol=0, atol=1e-6)
        # An older real step does change the newest position's output: the policy remembers.
        full = random_windows(32, seed=3)
        full[:, :, -1] = 1.0
        changed = full.clone()
        changed[:, 0, :-1] += 1.0
        assert (model.value(full) - model.value(changed)).abs().min() > 0


@pytest.mark.unit
def test_tensor_parallel_checks_and_plan() -> None:
    assert check_tensor_parallel(16, 4, 48, 2) is None
    assert check_tensor_parallel(16, 4, 48, 2, context=4) is None
    assert check_tensor_parallel(18, 3, 48, 2) == "heads 3 is not divisible by tensor_parallel_size 2"
    assert check_tensor_parallel(16, 3, 48, 1) == "width 16 is not divisible by heads 3"
    assert check_tensor_parallel(16, 4, 46, 4) == "hidden 46 is not divisible by tensor_parallel_size 4"
    assert check_tensor_parallel(16, 4, 48, 2, context=5) == (
        "context 5 is not divisible by tensor_parallel_size 2")
    assert check_tensor_parallel(16, 4, 48, 0) is not None
    for width in (8, 16, 24, 64, 100, 256):
        assert ffn_hidden(width) % 8 == 0 and ffn_hidden(width) >= 8 * width / 3

    torch.manual_seed(0)
    model = make_model(DISCRETE, layers=3)
    for sequence_parallel in (False, True):
        plan = tensor_parallel_plan(model, sequence_parallel)
        for name in plan:
            model.get_submodule(name)  # every entry names a module
        for block in ("layers.0", "layers.2"):
            for proj in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                         "feed_forward.w3"):
                assert isinstance(plan[f"{block}.{proj}"], ColwiseParallel)
            for proj in ("attention.wo", "feed_forward.w2"):
                assert isinstance(plan[f"{block}.{proj}"], RowwiseParallel)
            norms = [isinstance(plan.get(f"{block}.{n}"), SequenceParallel)
                     for n in ("attention_norm", "ffn_norm")]
            assert norms == [sequence_parallel] * 2
        # The replicated rest is not in the plan.
        assert not any(name.split(".")[0] in ("embed", "norm", "actor", "critic") for name in plan)
        assert ("layers.0" in plan) == ("layers.2" in plan) == sequence_parallel


# --- the windows --------------------------------------------------------------------------------


@pytest.mark.unit
def test_history_reset_leaves_one_real_step() -> None:
    history = ObsHistory(2, 3, 2)
    history.reset(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    want = torch.tensor([[[0.0, 0, 0], [0, 0, 0], [1, 2, 1]],
                         [[0.0, 0, 0], [0, 0, 0], [3, 4, 1]]])
    assert torch.equal(history.window(), want)


@pytest.mark.unit
def test_history_shifts_and_restarts_at_episode_boundaries() -> None:
    history = ObsHistory(2, 3, 1)
    history.reset(torch.tensor([[1.0], [10.0]]))
    history.push(torch.tensor([[2.0], [11.0]]), torch.tensor([False, False]))
    assert history.window()[:, :, 0].tolist() == [[0, 1, 2], [0, 10, 11]]
    assert history.window()[:, :, 1].tolist() == [[0, 1, 1], [0, 1, 1]]
    history.push(torch.tensor([[3.0], [12.0]]), torch.tensor([0.0, 0.0]))
    history.push(torch.tensor([[4.0], [13.0]]), torch.tensor([0.0, 0.0]))
    assert history.window()[:, :, 0].tolist() == [[2, 3, 4], [11, 12, 13]]  # the oldest fell out
    # Env 1's episode ended: 20 is the first observation of its next one.
    history.push(torch.tensor([[5.0], [20.0]]), torch.tensor([0.0, 1.0]))
    assert history.window()[:, :, 0].tolist() == [[3, 4, 5], [0, 0, 20]]
    assert history.window()[:, :, 1].tolist() == [[1, 1, 1], [0, 0, 1]]
    history.push(torch.tensor([[6.0], [21.0]]), torch.tensor([True, False]))
    assert history.window()[:, :, 0].tolist() == [[0, 0, 6], [0, 20, 21]]
    assert history.window()[:, :, 1].tolist() == [[0, 0, 1], [0, 1, 1]]


@pytest.mark.unit
def test_history_matches_a_list_of_each_envs_episode() -> None:
    num_envs, context, obs_dim = 4, 3, 2
    gen = torch.Generator().manual_seed(0)
    history = ObsHistory(num_envs, context, obs_dim)
    obs = torch.randn(num_envs, obs_dim, generator=gen)
    history.reset(obs)
    episodes: list[list[Tensor]] = [[row] for row in obs]
    for _ in range(40):
        obs = torch.randn(num_envs, obs_dim, generator=gen)
        done = torch.rand(num_envs, generator=gen) < 0.25
        history.push(obs, done)
        for i in range(num_envs):
            episodes[i] = [obs[i]] if done[i] else [*episodes[i], obs[i]]
        window = history.window()
        for i, steps in enumerate(episodes):
            real = steps[-context:]
            pad = context - len(real)
            assert torch.equal(window[i, pad:, :-1], torch.stack(real))
            assert torch.equal(window[i, :, -1], (torch.arange(context) >= pad).float())
            assert not window[i, :pad].any()


@pytest.mark.unit
def test_history_window_is_a_copy_and_shapes_are_checked() -> None:
    history = ObsHistory(2, 2, 1)
    history.reset(torch.zeros(2, 1))
    before = history.window()
    history.push(torch.ones(2, 1), torch.zeros(2))
    assert not torch.equal(before, history.window())
    with pytest.raises(ValueError, match=r"observations must be \[2, 1\]"):
        history.push(torch.ones(3, 1), torch.zeros(3))
    with pytest.raises(ValueError, match=r"done must be \[2\]"):
        history.push(torch.ones(2, 1), torch.zeros(2, 1))


@pytest.mark.unit
def test_history_window_with_appends_a_step_without_keeping_it() -> None:
    history = ObsHistory(3, 3, 1)
    history.reset(torch.tensor([[1.0], [10.0], [100.0]]))
    history.push(torch.tensor([[2.0], [11.0], [101.0]]), torch.tensor([0.0, 1.0, 0.0]))
    before = history.window()
    # Envs 2 and 0 (in that order) were cut: their last observations end their windows.
    got = history.window_with(torch.tensor([[102.0], [3.0]]), np.array([2, 0]))
    assert got[:, :, 0].tolist() == [[100, 101, 102], [1, 2, 3]]
    assert got[:, :, 1].tolist() == [[1, 1, 1], [1, 1, 1]]
    assert torch.equal(history.window(), before)  # the history itself is unchanged
    # What a push without a restart would give those envs.
    history.push(torch.tensor([[3.0], [12.0], [102.0]]), torch.zeros(3))
    assert torch.equal(got, history.window()[[2, 0]])
    assert history.window_with(torch.zeros(0, 1), []).shape == (0, 3, 2)
    with pytest.raises(ValueError, match=r"observations must be \[1, 1\]"):
        history.window_with(torch.zeros(2, 1), [0])


# --- the memory task ----------------------------------------------------------------------------


def _time_limits(env: gym.Env[Any, Any]) -> int:
    count = 0
    while isinstance(env, gym.Wrapper):
        count += isinstance(env, gym.wrappers.TimeLimit)
        env = env.env
    return count


@pytest.mark.unit
def test_masked_cartpole_is_cartpole_without_velocities() -> None:
    register_memory_envs()
    register_memory_envs()  # again: a no-op
    spec = gym.spec(MASKED_CARTPOLE_ID)
    assert spec.reward_threshold == 475 and spec.max_episode_steps == 500
    masked, full = masked_cartpole(), gym.make("CartPole-v1")
    try:
        space = masked.observation_space
        assert isinstance(space, gym_spaces.Box) and space.shape == (2,)
        assert space.dtype == np.float32
        assert transformer_space_problem(Spaces(space, masked.action_space)) is None
        assert _time_limits(masked) == 1 and masked.spec is not None
        assert masked.spec.max_episode_steps == 500
        obs, _ = masked.reset(seed=3)
        want, _ = full.reset(seed=3)
        for action in [0, 1, 1, 0, 1, 1, 1, 0]:
            assert np.array_equal(obs, want[[0, 2]]) and obs in space
            obs, reward, term, trunc, _ = masked.step(action)
            want, want_reward, want_term, want_trunc, _ = full.step(action)
            assert (reward, term, trunc) == (want_reward, want_term, want_trunc)
    finally:
        masked.close()
        full.close()
    # gym.make's "module:id" imports the module, which registers the id.
    env = gym.make(f"app.runtime.envs.memory:{MASKED_CARTPOLE_ID}")
    assert env.observation_space.shape == (2,)
    env.close()


@pytest.mark.unit
def test_windows_of_a_vector_env_never_cross_episodes() -> None:
    num_envs = 3
    envs = gym.vector.SyncVectorEnv([masked_cartpole] * num_envs,
                                    autoreset_mode=AutoresetMode.SAME_STEP)
    spaces = Spaces(envs.single_observation_space, envs.single_action_space)
    torch.manual_seed(0)
    model = TransformerActorCritic(spaces, WIDTH, 1, HEADS, CONTEXT)
    generator = torch.Generator().manual_seed(0)
    history = ObsHistory(num_envs, CONTEXT, 2)
    raw, _ = envs.reset(seed=0)
    history.reset(torch.as_tensor(raw))
    age = np.zeros(num_envs, np.int64)  # steps since each env's episode started
    ends = 0
    try:
        for _ in range(60):
            window = history.window()
            assert window[:, :, -1].sum(1).tolist() == np.minimum(age + 1, CONTEXT).tolist()
            assert torch.equal(window[:, -1, :-1], torch.as_tensor(raw))
            with torch.no_grad():
                action = model.act(window, generator)[0]
            raw, _, term, trunc, _ = envs.step(action.numpy())
            done = np.logical_or(term, trunc)
            history.push(torch.as_tensor(raw), torch.as_tensor(done))
            age = np.where(done, 0, age + 1)
            ends += int(done.sum())
    finally:
        envs.close()
    assert ends > 0  # episode boundaries were crossed
