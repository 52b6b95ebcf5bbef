"""The env's spaces as data (app/runtime/envs/spaces_wire.py): what rank 0 of a joined run hands
the other ranks round-trips without a pickle, and a space with no data form is left out."""

from __future__ import annotations

import pickle

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from app.runtime.core.algorithm import Spaces
from app.runtime.envs.spaces_wire import decode_spaces, encode_spaces

pytestmark = pytest.mark.unit

SPACES = [
    spaces.Box(low=np.array([-1.0, -2.0], dtype=np.float32), high=np.array([1.0, np.inf],
                                                                           dtype=np.float32)),
    spaces.Box(0, 255, shape=(4, 84, 84), dtype=np.uint8),
    spaces.Discrete(6),
    spaces.Discrete(3, start=-1),
    spaces.MultiDiscrete([3, 5, 2]),
    spaces.MultiBinary(7),
    spaces.Tuple((spaces.Discrete(2), spaces.Box(-1, 1, shape=(3,)))),
    spaces.Dict({"position": spaces.Box(-1, 1, shape=(2,)), "mode": spaces.Discrete(4)}),
]


@pytest.mark.parametrize("space", SPACES, ids=lambda s: type(s).__name__)
def test_each_space_round_trips_as_data(space: gym.Space, monkeypatch: pytest.MonkeyPatch) -> None:
    encoded = encode_spaces(Spaces(observation=space, action=spaces.Discrete(2)))
    assert encoded is not None

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    decoded = decode_spaces(encoded)
    assert decoded.observation == space
    assert decoded.observation.dtype == space.dtype
    assert decoded.action == spaces.Discrete(2)


def test_the_probed_spaces_of_a_real_env_round_trip() -> None:
    env = gym.make("Hopper-v5")
    probed = Spaces(observation=env.observation_space, action=env.action_space)
    env.close()
    encoded = encode_spaces(probed)
    assert encoded is not None
    decoded = decode_spaces(encoded)
    assert decoded.observation == probed.observation and decoded.action == probed.action


def test_a_space_with_no_data_form_is_left_to_each_rank_to_probe() -> None:
    assert encode_spaces(Spaces(observation=spaces.Text(5), action=spaces.Discrete(2))) is None
