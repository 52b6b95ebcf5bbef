"""The ConfigStore entries: the app's schema, the config groups' schemas, and each loop's.

A loop is a dataclass and is its own schema (:func:`loop_schema`); shipped loops are registered
as ``loop/<name>_schema``, and a plugin registers its own with :func:`register_loop`. The config
knows the shipped loops by name (:data:`SHIPPED_LOOPS`), as Hydra knows a ``_target_``: it
imports no loop module, so the loops sit below the config and never the other way round.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class

from app.config.schema import AppConfig, CommConfig, LayoutConfig

# ``loop=<name>`` -> the loop class its schema is made from.
SHIPPED_LOOPS = {
    "ppo": "app.loops.ppo.PPOLoop",
    "vtrace": "app.loops.vtrace.VTraceLoop",
    "dqn": "app.loops.dqn.DQNLoop",
    "sac": "app.loops.sac.SACLoop",
    "commcheck": "app.loops.commcheck.CommCheck",
}


@functools.cache
def loop_schema(loop_cls: type) -> type:
    """The structured config of a dataclass loop: its fields, typed, plus ``_target_``."""
    if not dataclasses.is_dataclass(loop_cls):
        raise TypeError(f"{loop_cls.__qualname__} is not a dataclass")
    hints = typing.get_type_hints(loop_cls)
    specs: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(loop_cls):
        if not f.init:
            continue
        if f.default_factory is not dataclasses.MISSING:
            copied = field(default_factory=f.default_factory, metadata=f.metadata)
        else:
            copied = field(default=f.default, metadata=f.metadata)
        specs.append((f.name, hints[f.name], copied))
    target = f"{loop_cls.__module__}.{loop_cls.__qualname__}"
    specs.append(("_target_", str, field(default=target)))
    return dataclasses.make_dataclass(f"{loop_cls.__name__}Config", specs)


def build_loop(loop: Any) -> Any:
    """The loop object a ``loop`` config node (a DictConfig) describes: ``instantiate(loop)``, its
    nested settings passed as they are (not instantiated: ``loop.env._target_`` names an env
    factory, which the loop calls itself). Validation builds it before launch
    (app/launch/planning.py), ``python -m app.evaluate`` from a run's saved config."""
    from hydra.utils import instantiate

    return instantiate(loop, _convert_="object", _recursive_=False)


def register_loop(name: str, loop_cls: type) -> None:
    """Make ``loop/<name>_schema`` the typed schema of ``loop_cls`` (a loop YAML file lists it in
    its defaults, as ``conf/loop/ppo.yaml`` does)."""
    ConfigStore.instance().store(group="loop", name=f"{name}_schema", node=loop_schema(loop_cls))


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="app_schema", node=AppConfig)
    cs.store(group="comm", name="comm_schema", node=CommConfig)
    cs.store(group="layout", name="layout_schema", node=LayoutConfig)
    for name, target in SHIPPED_LOOPS.items():
        register_loop(name, get_class(target))
