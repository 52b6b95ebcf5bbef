"""An env's spaces as data: JSON with raw array bytes, never a pickle.

Rank 0 of a joined run (torchrun, srun) probes the env once and leaves its spaces in the
rendezvous store for the other ranks (app/launch/rank.py). What crosses the network is read as
data only (weights and trajectories are too: tests/integration/test_weights_without_unpickling.py),
so the spaces travel in this form. The gymnasium spaces the runtime acts in are covered: Box,
Discrete, MultiDiscrete, MultiBinary, and Tuple and Dict of them; any other space is not
encoded (:func:`encode_spaces` gives None) and each rank then probes the env itself.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from gymnasium import spaces as gym_spaces

from app.runtime.core.algorithm import Spaces


def encode_spaces(spaces: Spaces) -> bytes | None:
    """``spaces`` as JSON bytes, or None when a space is of a kind not covered here."""
    try:
        data = {"observation": _encode(spaces.observation), "action": _encode(spaces.action)}
    except TypeError:
        return None
    return json.dumps(data).encode()


def decode_spaces(data: bytes) -> Spaces:
    """The :class:`Spaces` that :func:`encode_spaces` wrote."""
    parsed = json.loads(data)
    return Spaces(observation=_decode(parsed["observation"]), action=_decode(parsed["action"]))


def _array(values: np.ndarray) -> dict[str, Any]:
    values = np.ascontiguousarray(values)
    return {"dtype": values.dtype.str, "shape": list(values.shape),
            "bytes": base64.b64encode(values.tobytes()).decode()}


def _from_array(data: dict[str, Any]) -> np.ndarray:
    raw = base64.b64decode(data["bytes"])
    return np.frombuffer(raw, dtype=np.dtype(data["dtype"])).reshape(data["shape"]).copy()


def _encode(space: Any) -> dict[str, Any]:
    if isinstance(space, gym_spaces.Box):
        return {"kind": "Box", "low": _array(space.low), "high": _array(space.high),
                "dtype": np.dtype(space.dtype).str}
    if isinstance(space, gym_spaces.Discrete):
        return {"kind": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, gym_spaces.MultiDiscrete):
        return {"kind": "MultiDiscrete", "nvec": _array(space.nvec), "start": _array(space.start)}
    if isinstance(space, gym_spaces.MultiBinary):
        return {"kind": "MultiBinary", "n": np.asarray(space.n).tolist()}
    if isinstance(space, gym_spaces.Tuple):
        return {"kind": "Tuple", "spaces": [_encode(s) for s in space.spaces]}
    if isinstance(space, gym_spaces.Dict):
        return {"kind": "Dict", "spaces": {k: _encode(s) for k, s in space.spaces.items()}}
    raise TypeError(f"no data form for {type(space).__name__}")


def _decode(data: dict[str, Any]) -> Any:
    kind = data["kind"]
    if kind == "Box":
        return gym_spaces.Box(_from_array(data["low"]), _from_array(data["high"]),
                              dtype=np.dtype(data["dtype"]))
    if kind == "Discrete":
        return gym_spaces.Discrete(data["n"], start=data["start"])
    if kind == "MultiDiscrete":
        return gym_spaces.MultiDiscrete(_from_array(data["nvec"]), start=_from_array(data["start"]))
    if kind == "MultiBinary":
        return gym_spaces.MultiBinary(data["n"])
    if kind == "Tuple":
        return gym_spaces.Tuple([_decode(s) for s in data["spaces"]])
    if kind == "Dict":
        return gym_spaces.Dict({k: _decode(s) for k, s in data["spaces"].items()})
    raise ValueError(f"unknown space kind {kind!r}")
