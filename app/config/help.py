"""``python -m app --help``: the config groups a user picks from and every setting, with its
type, current value (defaults plus the overrides on the command line) and one-line doc."""

from __future__ import annotations

import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from app.config import AppConfig, loop_schema

GROUPS = ("comm", "layout", "loop", "hydra/launcher", "experiment")
OPTIONAL = {"experiment"}  # no default: picked with +experiment=NAME


def help_text(*, _root_: DictConfig) -> str:
    """The help page for the config as composed (an OmegaConf resolver: ``${rlcomm_help:}``)."""
    lines = [
        "python -m app [group=option ...] [key=value ...] [--multirun] [--help]",
        "",
        "Config groups (group=option; * marks the current choice):",
        *_group_lines(_root_),
        *_loop_layout_lines(_root_),
        "",
        "Settings (key=value; type, current value, what it does):",
    ]
    for f in dataclasses.fields(AppConfig):
        if f.name == "loop":
            continue
        lines += _field_lines(f.name, AppConfig, f, _root_.get(f.name))
    loop = _root_.get("loop")
    target = loop.get("_target_") if isinstance(loop, DictConfig) else None
    lines += ["", f"loop settings of {target}:"]
    lines += _loop_lines(loop, target)
    lines += ["", "Hydra's own flags:", "$FLAGS_HELP"]
    return "\n".join(lines)


def _group_lines(root: DictConfig) -> list[str]:
    chosen = {str(c).split("=")[0]: str(c).split("=")[-1] for c in _choices(root)}
    lines = []
    for group in GROUPS:
        current = chosen.get(group)
        options = sorted({*_options(group, root), *([current] if current else [])})
        options = [o for o in options if not o.endswith("_schema")]
        marked = [f"{o}*" if o == current else o for o in options]
        name = f"+{group}" if group in OPTIONAL else group
        lines.append(f"  {name + ':':<16}{', '.join(marked)}")
    return lines


def _loop_layout_lines(root: DictConfig) -> list[str]:
    """Each shipped loop's layout when the command line names none (its YAML's defaults)."""
    from app.config.provenance import choice_for

    layouts = {}
    for loop in sorted(o for o in _options("loop", root) if not o.endswith("_schema")):
        try:
            choice = choice_for("layout", [f"loop={loop}"])
        except Exception:  # a loop in a hydra.searchpath dir: composed only with that path
            continue
        if choice is not None:
            layouts[loop] = choice
    if not layouts:
        return []
    own = [f"{loop} {c.option}" for loop, c in layouts.items() if c.chosen_by != "app"]
    app_default = {c.option for c in layouts.values() if c.chosen_by == "app"}
    others = ", ".join(sorted(app_default))
    rest = f"; the others {others} (the app's default)" if app_default else ""
    return [f"  (each loop's layout unless layout=... is given: {', '.join(own) or 'none own one'}"
            f"{rest})"]


def _options(group: str, root: DictConfig) -> set[str]:
    """Every option of ``group``: the app's, plugins' and those in ``hydra.searchpath`` dirs."""
    from hydra.core.global_hydra import GlobalHydra

    options = set(GlobalHydra.instance().config_loader().get_group_options(group))
    for entry in OmegaConf.select(root, "hydra.searchpath") or []:
        if str(entry).startswith("file://"):
            options |= {p.stem for p in Path(str(entry)[7:], group).glob("*.yaml")}
    return options


def _choices(root: DictConfig) -> list[str]:
    runtime = OmegaConf.select(root, "hydra.runtime.choices")
    return [f"{k}={v}" for k, v in (runtime or {}).items()]


def _field_lines(key: str, owner: type, f: dataclasses.Field[Any], value: Any) -> list[str]:
    hint = typing.get_type_hints(owner)[f.name]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        lines = []
        for sub in dataclasses.fields(hint):
            sub_value = value.get(sub.name) if isinstance(value, DictConfig) else None
            lines += _field_lines(f"{key}.{sub.name}", hint, sub, sub_value)
        return lines
    shown = "???" if value is None and f.default is MISSING else _value(value)
    kind = f.metadata.get("type") or _type_name(hint)  # "type": a schema's name for an Any field
    return [f"  {key}: {kind} = {shown}  # {f.metadata.get('doc', '')}".rstrip(" #")]


def _loop_lines(loop: Any, target: Any) -> list[str]:
    try:
        from hydra.utils import get_object

        cls = get_object(str(target))
    except Exception:
        return ["  (the loop's class cannot be imported; see loop._target_)"]
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return ["  (not a dataclass: its arguments are not documented here)"]
    schema = loop_schema(cls)
    lines = []
    for f in dataclasses.fields(schema):
        if f.name != "_target_":
            value = loop.get(f.name) if isinstance(loop, DictConfig) else None
            lines += _field_lines(f"loop.{f.name}", schema, f, value)
    return lines


def _type_name(hint: Any) -> str:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "|".join(str(m.value) for m in hint)
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")


def _value(value: Any) -> str:
    if isinstance(value, DictConfig) or OmegaConf.is_list(value):
        return str(OmegaConf.to_container(value)).replace(" ", "")
    if isinstance(value, enum.Enum):
        return str(value.value)
    return "null" if value is None else str(value)
