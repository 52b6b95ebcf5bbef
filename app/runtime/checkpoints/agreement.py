"""What must agree between a checkpoint and the run resuming it: the settings a checkpoint records
(:func:`run_settings`) and the policy's tensor shapes, compared before any rank starts
(:func:`resume_mismatch`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np
import torch


def describe_space(space: Any) -> str:
    """A gymnasium space in a few words: its kind, size, shape and dtype (not its bounds)."""
    kind = type(space).__name__
    if hasattr(space, "n"):  # Discrete, MultiBinary
        return f"{kind}({int(space.n)})" if np.ndim(space.n) == 0 else f"{kind}({space.n.tolist()})"
    return f"{kind}(shape={tuple(space.shape) if space.shape is not None else None}, dtype={space.dtype})"


def run_settings(loop: Any, spaces: Any) -> dict[str, Any]:
    """Everything a resumed run must share with the checkpoint, by the name a user knows it:
    the algorithm (the loop's class, i.e. ``loop._target_``), the environment (its id, factory,
    spaces and which normalisers it has), every algorithm setting (the model's shape and what an
    update does) and the policy's (``loop.model``). Everything else (layout and trainer grid,
    ``loop.data_parallel``, budget, target, window, checkpoint_every,
    staleness, logging, seed, the vector env kind) may change."""
    target = type(loop)
    env = loop.env
    return {
        "loop._target_": f"{target.__module__}.{target.__qualname__}",
        "env.id": env.id,
        **({"env._target_": env._target_} if env._target_ else {}),
        "env.observation_space": describe_space(spaces.observation),
        "env.action_space": describe_space(spaces.action),
        "env.normalize_obs": env.normalize_obs,
        "env.normalize_reward": env.normalize_reward,
        **{f"loop.hparams.{name}": value for name, value in asdict(loop.hparams).items()},
        **{f"loop.model.{name}": value for name, value in asdict(loop.model).items()},
    }


def policy_shapes(policy: torch.nn.Module) -> dict[str, list[int]]:
    """The shape of every tensor of ``policy``."""
    return {name: list(t.shape) for name, t in policy.state_dict().items()}


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def resume_mismatch(state: Mapping[str, Any], settings: Mapping[str, Any],
                    shapes: Mapping[str, list[int]]) -> str | None:
    """The first disagreement between a checkpoint and this run, as one line, or None.
    Settings the checkpoint does not record (an old checkpoint, a setting added since) are not
    compared; the policy's tensor shapes always are."""
    saved = state.get("settings") or {}
    for key, value in settings.items():
        if key in saved and saved[key] != value:
            return f"loop.resume: checkpoint has {key}={_shown(saved[key])}, this run {_shown(value)}"
    # A sharded checkpoint records its shapes beside its shards, which are not read here.
    policy = state["policy_shapes"] if "policy_shapes" in state else {
        name: list(t.shape) for name, t in state["policy"].items()}
    for name, shape in shapes.items():
        if name not in policy:
            return f"loop.resume: checkpoint has no policy tensor {name}, this run {shape}"
        if list(policy[name]) != shape:
            return (f"loop.resume: checkpoint has policy tensor {name} of shape "
                    f"{list(policy[name])}, this run {shape}")
    extra = sorted(set(policy) - set(shapes))
    if extra:
        return f"loop.resume: checkpoint has policy tensor {extra[0]}, this run none"
    return None
