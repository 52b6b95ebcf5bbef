"""The vector env contract, checked for one kind of vector env (app/runtime/envs/vector.py).

The sync kind is checked in this process (tests/unit/test_envs.py); the async kind starts one
process per env, so its checks are integration tests (tests/integration/test_envs.py). Both
run these same checks.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.spaces import Box

from app.runtime.envs.vector import EnvConfig, make_vector_env, probe_spaces
from tests.helpers.image_env import ENV_ID as IMAGE_ID
from tests.helpers.image_env import register_image_env

IMAGE_FACTORY = "tests.helpers.image_env.make_image_env"


def check_step_for_step(kind: str, env_id: str) -> None:
    """Sub-env i is gym.make(id) seeded seed + i, reset in the same step as its episode ends
    (SAME_STEP), with the last observation in final_obs and the episode's return and length."""
    num_envs, seed, limit = 3, 7, 5  # kwargs reach gym.make: a time limit of 5 steps
    cfg = EnvConfig(id=env_id, kwargs={"max_episode_steps": limit}, vector=kind)
    envs = make_vector_env(cfg, num_envs, seed)
    refs = [gym.make(env_id, max_episode_steps=limit) for _ in range(num_envs)]
    try:
        obs, _ = envs.reset(seed=seed)
        ref_obs = [ref.reset(seed=seed + i)[0] for i, ref in enumerate(refs)]
        single = envs.single_observation_space
        assert obs.shape == (num_envs, *single.shape) and obs.dtype == single.dtype
        np.testing.assert_array_equal(obs, np.stack(ref_obs))
        returns, lengths, finished = np.zeros(num_envs), np.zeros(num_envs, int), 0
        envs.action_space.seed(0)
        for _ in range(2 * limit + 1):
            actions = envs.action_space.sample()
            obs, reward, term, trunc, info = envs.step(actions)
            assert reward.shape == term.shape == trunc.shape == (num_envs,)
            for i, ref in enumerate(refs):
                ref_obs[i], r, t, tr, _ = ref.step(actions[i])
                returns[i] += r
                lengths[i] += 1
                assert (reward[i], term[i], trunc[i]) == pytest.approx((r, t, tr))
                if t or tr:
                    finished += 1
                    assert info["_final_obs"][i] and info["_episode"][i]
                    np.testing.assert_array_equal(info["final_obs"][i], ref_obs[i])
                    assert info["episode"]["r"][i] == pytest.approx(returns[i])
                    assert info["episode"]["l"][i] == lengths[i] == limit
                    ref_obs[i], _ = ref.reset()
                    returns[i], lengths[i] = 0, 0
                else:
                    assert not info.get("_episode", np.zeros(num_envs, bool))[i]
                np.testing.assert_array_equal(obs[i], ref_obs[i])
    finally:
        envs.close()
        for ref in refs:
            ref.close()
    assert finished == 2 * num_envs  # two time limits each: the second counts the reset step


def check_same_seed_same_run(kind: str) -> None:
    """Two runs of one seed see the same observations; another seed does not."""

    def run(seed: int) -> np.ndarray:
        envs = make_vector_env(EnvConfig(id="Acrobot-v1", vector=kind), 2, seed)
        try:
            seen = [envs.reset(seed=seed)[0]]
            for t in range(5):
                seen.append(envs.step(np.array([t % 3, (t + 1) % 3]))[0])
        finally:
            envs.close()
        return np.stack(seen)

    first = run(11)
    np.testing.assert_array_equal(first, run(11))
    assert not np.array_equal(first, run(12))


def check_image_env_by_factory_and_by_id(kind: str) -> None:
    """The image env by its factory and by its registered id: the same spaces, and steps."""
    assert register_image_env() == register_image_env() == IMAGE_ID  # idempotent
    by_factory = EnvConfig(id="image", _target_=IMAGE_FACTORY, kwargs={"channels": 3},
                           vector=kind)
    by_id = EnvConfig(id=IMAGE_ID, kwargs={"channels": 3}, vector=kind)
    assert probe_spaces(by_factory) == probe_spaces(by_id) == probe_spaces(
        EnvConfig(_target_="tests.helpers.image_env.ImageSideEnv", kwargs={"channels": 3}))
    assert probe_spaces(by_id).observation == Box(0, 255, (36, 36, 3), np.uint8)
    for cfg in (by_factory, by_id):
        envs = make_vector_env(cfg, 2, seed=1)
        try:
            obs, reward, *_ = envs.step(np.array([0, 1]))
        finally:
            envs.close()
        assert obs.shape == (2, 36, 36, 3) and obs.dtype == np.uint8
        assert set(reward) <= {0.0, 1.0}
