"""The runtime's environments (app/runtime/envs/vector.py): the vector env contract for every kind
(SAME_STEP autoreset, final_obs, episode statistics, seeding), the synthetic image env the tests
ship, and each one-line error of the launcher's probe.

Sync and envpool here; the async vector env starts one process per env, so its tests are
integration tests (tests/integration/test_envs.py). The contract both kinds keep is checked by
tests/helpers/vector_envs.py.
"""

from __future__ import annotations

import importlib.util
import pickle
from dataclasses import fields
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.error import DependencyNotInstalled
from gymnasium.spaces import Box, Discrete
from gymnasium.wrappers.vector import RecordEpisodeStatistics
from omegaconf import OmegaConf

from app.api import ConfigError
from app.runtime.envs.vector import (
    EnvConfig,
    EnvPoolVectorEnv,
    make_env,
    make_vector_env,
    missing_package_line,
    probe_spaces,
)
from tests.helpers.image_env import (
    EPISODE_STEPS,
    ImageSideEnv,
    make_image_env,
    perfect_action,
)
from tests.helpers.vector_envs import (
    check_image_env_by_factory_and_by_id,
    check_same_seed_same_run,
    check_step_for_step,
)

IMAGE_FACTORY = "tests.helpers.image_env.make_image_env"
HAS_ENVPOOL = importlib.util.find_spec("envpool") is not None


def _probe_error(cfg: EnvConfig) -> str:
    with pytest.raises(ConfigError) as caught:
        probe_spaces(cfg)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- the config ------------------------------------------------------------------------------


@pytest.mark.unit
def test_config_is_a_structured_config_with_a_doc_per_field() -> None:
    node = OmegaConf.structured(EnvConfig)
    node.kwargs = {"max_episode_steps": 5}
    cfg = EnvConfig(**OmegaConf.to_container(node))  # type: ignore[arg-type]
    assert (cfg.id, cfg.kwargs, cfg._target_, cfg.vector) == (
        "CartPole-v1", {"max_episode_steps": 5}, None, "sync")
    assert (cfg.clip_obs, cfg.clip_reward) == (10.0, 10.0)
    assert all(f.metadata.get("doc") for f in fields(EnvConfig))
    assert EnvConfig().range_errors() == []


@pytest.mark.unit
def test_range_errors_name_the_field_and_value() -> None:
    assert EnvConfig(vector="x").range_errors() == [
        "env.vector: must be one of sync, async, envpool, got 'x'"]
    assert EnvConfig(clip_obs=0.0, clip_reward=-1.0).range_errors() == [
        "env.clip_obs: must be > 0, got 0.0", "env.clip_reward: must be > 0, got -1.0"]
    assert EnvConfig(vector="envpool", _target_=IMAGE_FACTORY).range_errors() == [
        "env.vector: must be sync or async with env._target_ (envpool builds its envs from an "
        "id, not a factory), got 'envpool'"]


# --- the vector env contract -----------------------------------------------------------------


@pytest.mark.unit
def test_sync_is_todays_cartpole_construction() -> None:
    """The default builds exactly what app/loops/ppo/core.make_envs built: same trajectory."""
    today = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(4)],
                                     autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    today = RecordEpisodeStatistics(today)
    today.reset(seed=3)
    ours = make_vector_env(EnvConfig(), 4, seed=3)
    assert isinstance(ours, RecordEpisodeStatistics)
    assert isinstance(ours.env, gym.vector.SyncVectorEnv)
    rng = np.random.default_rng(0)
    episodes = 0
    try:
        np.testing.assert_array_equal(today.reset(seed=3)[0], ours.reset(seed=3)[0])
        for _ in range(60):
            actions = rng.integers(2, size=4)
            for x, y in zip(today.step(actions), ours.step(actions), strict=True):
                if isinstance(x, dict):
                    assert x.keys() == y.keys()
                    episodes += int(np.sum(x.get("_episode", 0)))
                else:
                    np.testing.assert_array_equal(x, y)
    finally:
        today.close()
        ours.close()
    assert episodes > 0  # the comparison covered autoresets


@pytest.mark.unit
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_vector_env_is_its_single_envs_step_for_step(env_id: str) -> None:
    check_step_for_step("sync", env_id)


@pytest.mark.unit
def test_same_seed_same_run() -> None:
    check_same_seed_same_run("sync")


@pytest.mark.unit
def test_env_functions_pickle_for_spawned_processes() -> None:
    fn = partial(make_env, "ignored", IMAGE_FACTORY, {"height": 40})
    env = pickle.loads(pickle.dumps(fn))()
    assert env.observation_space.shape == (40, 36, 1)
    env.close()


# --- envpool ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_envpool_probe_or_its_install_line() -> None:
    cfg = EnvConfig(vector="envpool")
    if HAS_ENVPOOL:
        assert probe_spaces(cfg) == probe_spaces(EnvConfig())
        assert _probe_error(EnvConfig(id="CartPol-v1", vector="envpool")).startswith(
            "loop.env.id: 'CartPol-v1' is not an envpool task; did you mean 'CartPole-v1'")
    else:
        assert _probe_error(cfg) == (
            "loop.env.vector: envpool is not installed: pip install 'rlcomm[envpool]'")
    assert _probe_error(EnvConfig(vector="envpool", _target_=IMAGE_FACTORY)).startswith(
        "loop.env.vector: must be sync or async with env._target_")


@pytest.mark.unit
@pytest.mark.skipif(not HAS_ENVPOOL, reason="envpool is not installed (the envpool extra)")
def test_envpool_keeps_the_contract() -> None:
    num_envs, limit = 3, 5
    cfg = EnvConfig(kwargs={"max_episode_steps": limit}, vector="envpool")
    envs = make_vector_env(cfg, num_envs, seed=4)
    try:
        obs, _ = envs.reset(seed=4)
        np.testing.assert_array_equal(obs, envs.reset(seed=4)[0])  # reset(seed) starts over
        for i in range(num_envs):  # sub-env i is seeded with seed + i
            one = EnvPoolVectorEnv("CartPole-v1", 1, seed=4 + i)
            np.testing.assert_array_equal(obs[i], one.reset()[0][0])
            one.close()
        for step in range(1, 2 * limit + 1):
            last = obs
            obs, reward, term, trunc, info = envs.step(np.ones(num_envs, dtype=np.int64))
            np.testing.assert_array_equal(reward, np.ones(num_envs))  # no envpool reset step
            assert not term.any()
            if step % limit:
                assert "_episode" not in info and "final_obs" not in info
                continue
            assert trunc.all() and info["_episode"].all() and info["_final_obs"].all()
            np.testing.assert_array_equal(info["episode"]["l"], limit)
            np.testing.assert_array_equal(info["episode"]["r"], float(limit))
            for i in range(num_envs):  # the final obs follows the last; obs starts anew
                assert abs(info["final_obs"][i][0] - last[i][0]) < 0.1
                assert np.abs(obs[i]).max() <= 0.05 < np.abs(info["final_obs"][i]).max()
    finally:
        envs.close()


# --- the image env ---------------------------------------------------------------------------


@pytest.mark.unit
def test_image_env_observations_and_determinism() -> None:
    a, b = make_image_env(), make_image_env()
    obs, _ = a.reset(seed=5)
    assert obs.shape == (36, 36, 1) and obs.dtype == np.uint8 and a.observation_space.contains(obs)
    assert a.action_space == Discrete(2)
    assert sorted(np.unique(obs)) == [0, 255] and (obs == 255).sum() == 8 * 8
    np.testing.assert_array_equal(obs, b.reset(seed=5)[0])
    for action in [0, 1, 1, 0]:
        np.testing.assert_array_equal(a.step(action)[0], b.step(action)[0])
    assert not np.array_equal(make_image_env().reset(seed=6)[0], obs)


@pytest.mark.unit
def test_image_env_perfect_policy_gets_the_max_and_random_half() -> None:
    env = make_image_env()
    rng = np.random.default_rng(0)

    def episode(policy: Any, seed: int) -> tuple[float, int]:
        obs, _ = env.reset(seed=seed)
        total, steps, done = 0.0, 0, False
        while not done:
            obs, reward, term, trunc, _ = env.step(policy(obs))
            total, steps, done = total + float(reward), steps + 1, term or trunc
        return total, steps

    assert [episode(perfect_action, s) for s in range(20)] == [(8.0, EPISODE_STEPS)] * 20
    random_returns = [episode(lambda _: int(rng.integers(2)), s)[0] for s in range(400)]
    assert 3.7 < np.mean(random_returns) < 4.3  # 8 coin flips: 4 +- 0.07 over 400 episodes


@pytest.mark.unit
def test_image_env_fits_the_nature_cnn() -> None:
    obs, _ = make_image_env().reset(seed=0)
    cnn = torch.nn.Sequential(torch.nn.Conv2d(1, 32, 8, 4), torch.nn.Conv2d(32, 64, 4, 2),
                              torch.nn.Conv2d(64, 64, 3, 1))
    image = torch.as_tensor(obs).permute(2, 0, 1)[None].float()  # HxWxC -> 1xCxHxW
    assert cnn(image).shape == (1, 64, 1, 1)


@pytest.mark.unit
def test_image_env_by_factory_and_by_id() -> None:
    check_image_env_by_factory_and_by_id("sync")


# --- the probe: spaces, and one line per problem ---------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1", "Acrobot-v1"])
def test_probe_returns_the_spaces(env_id: str) -> None:
    env = gym.make(env_id)
    spaces = probe_spaces(EnvConfig(id=env_id))
    assert (spaces.observation, spaces.action) == (env.observation_space, env.action_space)
    env.close()


@pytest.mark.unit
def test_probe_mujoco_or_its_install_line() -> None:
    cfg = EnvConfig(id="Hopper-v5")
    if importlib.util.find_spec("mujoco") is not None:
        spaces = probe_spaces(cfg)
        assert spaces.observation.shape == (11,) and spaces.action.shape == (3,)
    else:
        assert _probe_error(cfg) == "loop.env.id: Hopper-v5 needs MuJoCo: pip install 'rlcomm[mujoco]'"


@pytest.mark.unit
def test_probe_atari_or_its_install_line() -> None:
    cfg = EnvConfig(id="ALE/Pong-v5")
    if importlib.util.find_spec("ale_py") is not None:
        spaces = probe_spaces(cfg)
        assert spaces.observation == Box(0, 255, (210, 160, 3), np.uint8)
        assert spaces.action == Discrete(6)
    else:
        assert _probe_error(cfg) == (
            "loop.env.id: ALE/Pong-v5 needs ale-py (Atari): pip install 'rlcomm[atari]'")


@pytest.mark.unit
def test_missing_package_lines_name_the_extra() -> None:
    # The exceptions gymnasium raises without MuJoCo, and an import without ale-py.
    mujoco = DependencyNotInstalled('MuJoCo is not installed, run `pip install "gymnasium[mujoco]"`')
    assert missing_package_line("Hopper-v5", mujoco) == (
        "loop.env.id: Hopper-v5 needs MuJoCo: pip install 'rlcomm[mujoco]'")
    ale = ModuleNotFoundError("No module named 'ale_py'", name="ale_py")
    assert missing_package_line("ALE/Breakout-v5", ale) == (
        "loop.env.id: ALE/Breakout-v5 needs ale-py (Atari): pip install 'rlcomm[atari]'")
    other = DependencyNotInstalled("Box2D is not installed, run `pip install \"gymnasium[box2d]\"`")
    assert missing_package_line("LunarLander-v3", other) == (
        "loop.env.id: LunarLander-v3 needs a package that is not installed: Box2D is not "
        "installed, run `pip install \"gymnasium[box2d]\"`")


@pytest.mark.unit
def test_probe_of_an_env_whose_package_is_missing() -> None:
    """Box2D is no extra of ours: gymnasium's own DependencyNotInstalled line, for real."""
    cfg = EnvConfig(id="LunarLander-v3")
    if importlib.util.find_spec("Box2D") is not None:
        assert probe_spaces(cfg).action == Discrete(4)
    else:
        assert _probe_error(cfg).startswith(
            "loop.env.id: LunarLander-v3 needs a package that is not installed: Box2D is not installed")


@pytest.mark.unit
def test_unknown_id_suggests_close_matches() -> None:
    assert _probe_error(EnvConfig(id="CartPol-v1")) == (
        "loop.env.id: 'CartPol-v1' is not a registered Gymnasium environment; did you mean "
        "'CartPole-v1' or 'CartPole-v0' or 'MaskedCartPole-v1'?")
    assert _probe_error(EnvConfig(id="Zzzzqqq-v9")) == (
        "loop.env.id: 'Zzzzqqq-v9' is not a registered Gymnasium environment")
    assert _probe_error(EnvConfig(id="no_such_module:Foo-v0")).startswith(
        "loop.env.id: cannot import 'no_such_module' for 'no_such_module:Foo-v0' (No module named")


@pytest.mark.unit
def test_rejected_kwargs_name_the_env_and_the_kwargs() -> None:
    assert _probe_error(EnvConfig(kwargs={"foo": 1})) == (
        "loop.env.kwargs: CartPole-v1 rejects {'foo': 1}: CartPoleEnv.__init__() got an "
        "unexpected keyword argument 'foo'")
    assert _probe_error(EnvConfig(_target_="tests.helpers.image_env.ImageSideEnv",
                                  kwargs={"foo": 1})) == (
        "loop.env.kwargs: tests.helpers.image_env.ImageSideEnv rejects {'foo': 1}: got an "
        "unexpected keyword argument 'foo'")


@pytest.mark.unit
@pytest.mark.parametrize(("target", "kwargs", "line"), [
    ("no_such_pkg.make", {},
     "loop.env._target_: cannot import 'no_such_pkg.make' (No module named 'no_such_pkg')"),
    ("tests.helpers.image_env.nope", {},
     "loop.env._target_: cannot import 'tests.helpers.image_env.nope' (module "
     "'tests.helpers.image_env' has no attribute 'nope')"),
    ("make_image_env", {},
     "loop.env._target_: cannot import 'make_image_env' ('make_image_env' is not a dotted path "
     "module.name)"),
    ("math.pi", {}, "loop.env._target_: 'math.pi' is not callable"),
    ("builtins.dict", {}, "loop.env._target_: builtins.dict returned dict, not a gymnasium.Env"),
    (IMAGE_FACTORY, {"width": 4},
     f"loop.env._target_: {IMAGE_FACTORY}(**{{'width': 4}}) raised ValueError: a 8-pixel block "
     "needs an image of at least 8x16"),
])
def test_bad_factory_is_one_line(target: str, kwargs: dict[str, Any], line: str) -> None:
    assert _probe_error(EnvConfig(_target_=target, kwargs=kwargs)) == line


@pytest.mark.unit
def test_bad_vector_kind_and_clip_are_one_line() -> None:
    assert _probe_error(EnvConfig(vector="ray")) == (
        "loop.env.vector: must be one of sync, async, envpool, got 'ray'")
    assert _probe_error(EnvConfig(clip_reward=0.0)) == "loop.env.clip_reward: must be > 0, got 0.0"


@pytest.mark.unit
def test_image_env_helper_is_a_gymnasium_env() -> None:
    env = ImageSideEnv(height=48, width=64)
    assert isinstance(env, gym.Env) and env.observation_space.shape == (48, 64, 1)


# --- WaitingCartPole-v1: a step that waits, not computes ---------------------------------------


@pytest.mark.unit
def test_the_waiting_cartpole_steps_as_cartpole_after_waiting_its_latency() -> None:
    import time

    from app.runtime.envs.waiting import WAITING_CARTPOLE_ID

    assert probe_spaces(EnvConfig(id=WAITING_CARTPOLE_ID)).action == Discrete(2)
    waiting = gym.make(WAITING_CARTPOLE_ID, latency_s=0.02)
    plain = gym.make("CartPole-v1")
    tick = time.monotonic()
    observed, _ = waiting.reset(seed=3)
    expected, _ = plain.reset(seed=3)
    for action in (0, 1, 1, 0):
        np.testing.assert_array_equal(observed, expected)
        observed, *_ = waiting.step(action)
        expected, *_ = plain.step(action)
    assert time.monotonic() - tick >= 5 * 0.02  # a reset and four steps, each after its wait
    assert waiting.spec is not None and waiting.spec.max_episode_steps == 500
    with pytest.raises(ValueError, match=r"latency_s: must be a number of seconds >= 0, got -1"):
        gym.make(WAITING_CARTPOLE_ID, latency_s=-1)
