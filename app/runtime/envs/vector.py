"""Environments: which one a run uses (:class:`EnvConfig`), its vector env
(:func:`make_vector_env`) and its spaces, learnt before launch (:func:`probe_spaces`).

Every vector env, whichever kind, keeps one contract the runtime relies on:

- ``SAME_STEP`` autoreset (CleanRL's semantics): the observation returned with ``done=True`` is
  already the first one of the next episode, so every step of a rollout is a real transition;
- ``info["final_obs"]`` (an object array, ``None`` where no episode ended; mask
  ``info["_final_obs"]``) holds the last observation of each finished episode, to bootstrap
  episodes cut by a time limit;
- ``info["_episode"]`` marks the envs whose episode ended, ``info["episode"]["r"]`` and
  ``["l"]`` their return and length (Gymnasium's ``RecordEpisodeStatistics``);
- sub-env ``i`` is seeded with ``seed + i``; ``reset(seed=s)`` starts them all over alike;
- Box actions are stepped as given: the runtime clips them to the space itself.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space
from gymnasium.wrappers.vector import RecordEpisodeStatistics

from app.api import ConfigError, setting
from app.runtime.core.algorithm import Spaces
from app.runtime.envs.memory import register_memory_envs
from app.runtime.envs.waiting import register_waiting_envs

__all__ = [
    "VECTOR_KINDS",
    "EnvConfig",
    "EnvPoolVectorEnv",
    "ensure_registered",
    "make_env",
    "make_vector_env",
    "missing_package_line",
    "probe_spaces",
]

VECTOR_KINDS = ("sync", "async", "envpool")
_ATARI_PREFIX = "ALE/"
_EXTRA_HINT = "pip install 'rlcomm[{}]'"


@dataclass
class EnvConfig:
    """``loop.env``: the environment every collecting rank builds ``num_envs`` copies of."""

    id: str = setting("CartPole-v1", "any registered Gymnasium id (with _target_: only the env's name in records)")
    kwargs: dict[str, Any] = setting(doc="keyword arguments for gym.make (or the factory)", factory=dict)
    # The runtime instantiates loops with _recursive_=False, so Hydra never calls this itself.
    _target_: str | None = setting(None, "dotted path of your own factory (**kwargs) -> gymnasium.Env; null: gym.make(id)")
    vector: str = setting("sync", "sync | async (Gymnasium's vector envs) | envpool (the envpool extra; id is an envpool task)")
    normalize_obs: bool = setting(False, "running normalisation of observations")
    normalize_reward: bool = setting(False, "scale rewards by the running std of the discounted return")
    clip_obs: float = setting(10.0, "clip normalised observations to [-clip_obs, clip_obs] (> 0)")
    clip_reward: float = setting(10.0, "clip scaled rewards to [-clip_reward, clip_reward] (> 0)")

    def range_errors(self) -> list[str]:
        """Out-of-range settings as ``env.field: must be ..., got value`` (empty when all fit)."""
        errors = []
        if self.vector not in VECTOR_KINDS:
            errors.append(f"env.vector: must be one of {', '.join(VECTOR_KINDS)}, got {self.vector!r}")
        elif self.vector == "envpool" and self._target_:
            errors.append("env.vector: must be sync or async with env._target_ (envpool builds its "
                          "envs from an id, not a factory), got 'envpool'")
        for name in ("clip_obs", "clip_reward"):
            if not getattr(self, name) > 0:
                errors.append(f"env.{name}: must be > 0, got {getattr(self, name)}")
        return errors


# ---------------------------------------------------------------------------------------------
# Building environments (on the ranks)


class EnvError(RuntimeError):
    """An environment raised while a rank stepped it: the message names the env and the
    exception (the launcher's line adds the rank)."""


def ensure_registered(env_id: str) -> None:
    """Register the ids of the package ``env_id`` needs, where Gymnasium does not by itself:
    ``ALE/...`` ids exist once ``ale_py`` is imported (raises ModuleNotFoundError without it);
    the runtime's own tasks (``MaskedCartPole-v1``, ``WaitingCartPole-v1``) once registered
    here."""
    register_memory_envs()
    register_waiting_envs()
    if env_id.startswith(_ATARI_PREFIX) and env_id not in gym.registry:
        import ale_py

        gym.register_envs(ale_py)


def make_env(env_id: str, target: str | None, kwargs: Mapping[str, Any]) -> gym.Env[Any, Any]:
    """One environment: the factory at ``target`` called with ``kwargs`` when set, else
    ``gym.make(env_id, **kwargs)``. Module-level, so ``partial(make_env, ...)`` pickles."""
    if target:
        return _locate(target)(**kwargs)
    ensure_registered(env_id)
    return gym.make(env_id, **kwargs)


def make_vector_env(cfg: EnvConfig, num_envs: int, seed: int) -> gym.vector.VectorEnv:
    """``num_envs`` seeded copies of ``cfg``'s env as one vector env that records episode
    statistics, already reset with ``seed`` (sub-env ``i`` with ``seed + i``).

    ``sync`` steps them in this process, ``async`` in one subprocess each (the platform's
    default start method; the env functions pickle, so ``spawn`` works too), ``envpool`` in
    envpool's C++ pool (:class:`EnvPoolVectorEnv`).
    """
    envs: gym.vector.VectorEnv
    if cfg.vector == "envpool":
        envs = EnvPoolVectorEnv(cfg.id, num_envs, cfg.kwargs)
    else:
        fns = [partial(make_env, cfg.id, cfg._target_, dict(cfg.kwargs)) for _ in range(num_envs)]
        if cfg.vector == "async":
            envs = gym.vector.AsyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
        else:
            envs = gym.vector.SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    envs = RecordEpisodeStatistics(envs)
    envs.reset(seed=seed)  # sub-env i is seeded with seed + i
    return envs


def _import_envpool() -> Any:
    try:
        import envpool
    except ImportError:
        raise ConfigError(
            f"loop.env.vector: envpool is not installed: {_EXTRA_HINT.format('envpool')}"
        ) from None
    return envpool


class EnvPoolVectorEnv(gym.vector.VectorEnv):
    """envpool's pool of ``num_envs`` envs (Gymnasium API) with the runtime's contract.

    envpool resets a finished env on the *next* step (``NEXT_STEP``, which returns that env's
    first observation with reward 0 and ignores its action). This adapter resets finished envs
    in the same step instead, so the step that ends an episode returns the next episode's first
    observation, and keeps the last one in ``info["final_obs"]``. envpool seeds env ``i`` with
    ``seed + i`` when the pool is made, so ``reset(seed=s)`` makes a new pool.

    ``env_id`` is an envpool task id (``envpool.list_all_envs()``; Atari is ``Pong-v5``, not
    ``ALE/Pong-v5``, with envpool's own preprocessing: 84x84 grey, 4 frames, channels first);
    ``kwargs`` go to ``envpool.make``.
    """

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, env_id: str, num_envs: int, kwargs: Mapping[str, Any] | None = None,
                 seed: int = 0) -> None:
        self._envpool = _import_envpool()
        self.env_id, self.num_envs, self._kwargs = env_id, num_envs, dict(kwargs or {})
        self._pool = self._make_pool(seed)
        self.single_observation_space = self._pool.observation_space
        self.single_action_space = self._pool.action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)

    def _make_pool(self, seed: int) -> Any:
        return self._envpool.make(self.env_id, env_type="gymnasium", num_envs=self.num_envs,
                                  seed=seed, **self._kwargs)

    def reset(self, *, seed: int | list[int] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        if isinstance(seed, list):
            raise ValueError("envpool seeds env i with seed + i: reset takes one int seed")
        if seed is not None:
            self._pool.close()
            self._pool = self._make_pool(seed)
        obs, info = self._pool.reset(options=options)
        return _in_env_order((obs, info), info["env_id"])

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        result = self._pool.step(np.asarray(actions))
        obs, reward, terminated, truncated, info = _in_env_order(result, result[-1]["env_id"])
        done = np.logical_or(terminated, truncated)
        if done.any():
            ids = np.flatnonzero(done)
            final = np.full(self.num_envs, None, dtype=object)
            for i in ids:
                final[i] = obs[i].copy()
            first, first_info = self._pool.reset(ids.astype(np.int32))
            obs = obs.copy()
            obs[np.asarray(first_info["env_id"])] = first
            info = {**info, "final_obs": final, "_final_obs": done}
        return obs, reward, terminated, truncated, info

    def close_extras(self, **kwargs: Any) -> None:
        self._pool.close()


def _in_env_order(tree: Any, env_ids: Any) -> Any:
    """``tree`` (arrays with one row per env, in the order of ``env_ids``, in tuples and dicts)
    with its rows in env order."""
    order = np.asarray(env_ids)
    if np.array_equal(order, np.arange(len(order))):
        return tree
    if isinstance(tree, tuple):
        return tuple(_in_env_order(x, order) for x in tree)
    if isinstance(tree, dict):
        return {k: _in_env_order(v, order) for k, v in tree.items()}
    if isinstance(tree, np.ndarray) and tree.ndim and len(tree) == len(order):
        out = np.empty_like(tree)
        out[order] = tree
        return out
    return tree


# ---------------------------------------------------------------------------------------------
# Probing (in the launcher, before any rank starts)


def probe_spaces(cfg: EnvConfig) -> Spaces:
    """The spaces of one env built from ``cfg`` (then closed; nothing is stepped or reset).

    Every problem is a :class:`ConfigError` of one line naming the setting and its value: an
    unknown id (with close matches), kwargs the env rejects, a missing optional package (with
    the extra to install), a factory that cannot be imported, raises or returns no env.
    """
    errors = cfg.range_errors()
    if errors:
        raise ConfigError(f"loop.{errors[0]}")
    if cfg.vector == "envpool":
        return _probe_envpool(cfg)
    if cfg._target_:
        env = _call_factory(cfg._target_, cfg.kwargs)
    else:
        env = _make_registered(cfg.id, cfg.kwargs)
    try:
        return Spaces(observation=env.observation_space, action=env.action_space)
    finally:
        env.close()


def missing_package_line(env_id: str, err: BaseException) -> str:
    """The one line for ``env_id`` when building it raised ``err`` for want of a package
    (``gymnasium.error.DependencyNotInstalled`` or an ImportError): which extra to install."""
    if env_id.startswith(_ATARI_PREFIX):
        return f"loop.env.id: {env_id} needs ale-py (Atari): {_EXTRA_HINT.format('atari')}"
    spec = gym.registry.get(env_id)
    entry = spec.entry_point if spec is not None and isinstance(spec.entry_point, str) else ""
    if ".mujoco" in entry or "mujoco" in str(err).lower():
        return f"loop.env.id: {env_id} needs MuJoCo: {_EXTRA_HINT.format('mujoco')}"
    return f"loop.env.id: {env_id} needs a package that is not installed: {_first_line(err)}"


def check_env_names(cfg: EnvConfig) -> None:
    """What :func:`probe_spaces` checks without building an env: the id is registered (its
    package installed), or the factory imports, is callable and takes ``kwargs``. Each problem
    is the same one line. Ranks that receive the spaces from another process run this instead
    (app/runtime/settings/schema.py: ``RunSettings.validate_settings``)."""
    if cfg.vector == "envpool":
        return  # envpool's ids are its own: its probe checks them
    if cfg._target_:
        _factory(cfg._target_, cfg.kwargs)
    else:
        _registered_name(cfg.id)


def _registered_name(env_id: str) -> str:
    """The registry name of ``env_id`` (its module imported first for ``module:Name-v0``);
    a missing package, module or id is one line."""
    try:
        ensure_registered(env_id)
    except ImportError as err:
        raise ConfigError(missing_package_line(env_id, err)) from None
    if ":" in env_id:  # gym.make's "module:Name-v0": import module, then look up Name-v0
        module, _, name = env_id.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"loop.env.id: cannot import {module!r} for {env_id!r} "
                              f"({_first_line(err)})") from None
    else:
        name = env_id
    if name not in gym.registry:
        raise ConfigError(_unknown_id_line(env_id, name, list(gym.registry)))
    return name


def _make_registered(env_id: str, kwargs: Mapping[str, Any]) -> gym.Env[Any, Any]:
    """``gym.make(env_id, **kwargs)``, each failure as the one line naming its setting."""
    name = _registered_name(env_id)
    try:
        return gym.make(env_id, **kwargs)
    except (gym.error.DependencyNotInstalled, ImportError) as err:
        raise ConfigError(missing_package_line(name, err)) from None
    except Exception as err:
        # gym.make re-raises a TypeError as "<it> was raised from the environment creator for
        # <id> with kwargs (...)": the line names both already, so it keeps the original.
        cause = err.__context__
        if type(cause) is type(err) and str(err).startswith(str(cause)):
            err = cause
        if kwargs:
            raise ConfigError(
                f"loop.env.kwargs: {env_id} rejects {dict(kwargs)}: {_first_line(err)}") from None
        raise ConfigError(f"loop.env.id: {env_id} cannot be built: {_first_line(err)}") from None


def _call_factory(target: str, kwargs: Mapping[str, Any]) -> gym.Env[Any, Any]:
    """The user's factory called with ``kwargs``, each failure as one line."""
    factory = _factory(target, kwargs)
    try:
        env = factory(**kwargs)
    except Exception as err:
        raise ConfigError(f"loop.env._target_: {target}(**{dict(kwargs)}) raised "
                          f"{type(err).__name__}: {_first_line(err)}") from None
    if not isinstance(env, gym.Env):
        raise ConfigError(f"loop.env._target_: {target} returned {type(env).__name__}, "
                          "not a gymnasium.Env")
    return env


def _factory(target: str, kwargs: Mapping[str, Any]) -> Callable[..., Any]:
    """The user's factory, imported and checked against ``kwargs`` (not called)."""
    try:
        factory = _locate(target)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"loop.env._target_: cannot import {target!r} ({_first_line(err)})") from None
    if not callable(factory):
        raise ConfigError(f"loop.env._target_: {target!r} is not callable")
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"loop.env.kwargs: {target} rejects {dict(kwargs)}: {_first_line(err)}") from None
    except ValueError:
        pass  # no signature to check (some builtins): calling it tells
    return factory


def _probe_envpool(cfg: EnvConfig) -> Spaces:
    envpool = _import_envpool()
    known = list(envpool.list_all_envs())
    if cfg.id not in known:
        raise ConfigError(_unknown_id_line(cfg.id, cfg.id, known, what="an envpool task"))
    try:
        pool = envpool.make(cfg.id, env_type="gymnasium", num_envs=1, **cfg.kwargs)
    except Exception as err:
        if cfg.kwargs:
            raise ConfigError(f"loop.env.kwargs: {cfg.id} rejects {dict(cfg.kwargs)}: "
                              f"{_first_line(err)}") from None
        raise ConfigError(f"loop.env.id: {cfg.id} cannot be built: {_first_line(err)}") from None
    try:
        return Spaces(observation=pool.observation_space, action=pool.action_space)
    finally:
        pool.close()


def _unknown_id_line(env_id: str, name: str, known: list[str],
                     what: str = "a registered Gymnasium environment") -> str:
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"loop.env.id: {env_id!r} is not {what}{hint}"


def _locate(path: str) -> Callable[..., Any]:
    """The object at dotted ``path`` (``package.module.name``, or ``package.module:name``)."""
    module, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module or not name:
        raise ValueError(f"{path!r} is not a dotted path module.name")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
