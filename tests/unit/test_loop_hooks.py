"""The loop contract's hooks (app.api.Loop): a loop that defines only ``__call__`` gets every
default, one that defines a hook gets its own, and the app reads them only through
``LoopHooks``, never by probing the loop for a member."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from app.api import ConfigError, Loop, LoopHooks, LoopMetrics
from app.metrics import declared_metrics
from rlcomm import LayoutSpec, plan_layout

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PLAN = plan_layout(LayoutSpec(world_size=2, trainers=[0], rollouts=[1]))
HOOKS = ("metrics", "elastic_rollouts", "replay_ranks_supported", "sharded_trainers",
         "data_parallel", "threads", "validate", "validate_settings", "check_seed", "summary")


class Bare:
    def __call__(self, ctx: Any, job: Any) -> dict[str, Any]:
        return {}


@dataclass
class Checked:
    """Defines every hook; ``validate`` records whether it ran."""

    ran: list[str]
    metrics: ClassVar[LoopMetrics] = LoopMetrics({"score": "max"}, headline=("score",))
    elastic_rollouts: ClassVar[bool] = True
    replay_ranks_supported: ClassVar[bool] = False

    def __call__(self, ctx: Any, job: Any) -> dict[str, Any]:
        return {}

    def validate(self, plan: Any) -> None:
        self.ran.append("validate")

    def check_seed(self, seed: int, plan: Any) -> None:
        if seed < 0:
            raise ConfigError(f"seed: must be >= 0, got {seed}")

    def summary(self, result: dict[str, Any], run_dir: Path) -> dict[str, Any]:
        return {"score": result["score"]}


def test_a_loop_with_only_call_gets_every_default() -> None:
    hooks = LoopHooks(Bare())
    assert hooks.metrics == LoopMetrics({})
    assert hooks.elastic_rollouts is False and hooks.replay_ranks_supported is None
    hooks.validate(PLAN)
    hooks.validate_settings(PLAN)
    hooks.check_seed(-1, PLAN)
    assert hooks.summary({"score": 1}, Path("run")) is None


def test_a_loops_own_hooks_answer_and_validate_settings_defaults_to_validate() -> None:
    ran: list[str] = []
    hooks = LoopHooks(Checked(ran))
    assert hooks.metrics.headline == ("score",)
    assert hooks.elastic_rollouts is True and hooks.replay_ranks_supported is False
    hooks.validate_settings(PLAN)  # it has no checks that build nothing: its whole validate
    assert ran == ["validate"]
    with pytest.raises(ConfigError, match="seed: must be >= 0"):
        hooks.check_seed(-1, PLAN)
    assert hooks.summary({"score": 3}, Path("run")) == {"score": 3}
    assert declared_metrics(f"{__name__}.Checked") == Checked.metrics  # read from the class


def test_a_setting_named_like_a_hook_is_no_hook() -> None:
    @dataclass
    class Quiet(Bare):
        summary: bool = True  # a loop's own setting, not a method
        metrics: str = "none"

    hooks = LoopHooks(Quiet())
    assert hooks.summary({}, Path("run")) is None and hooks.metrics == LoopMetrics({})


def test_a_loop_that_subclasses_loop_inherits_the_same_defaults() -> None:
    class Sub(Loop):
        def __call__(self, ctx: Any, job: Any) -> dict[str, Any]:
            return {}

    loop = Sub()
    assert (loop.metrics, loop.elastic_rollouts, loop.replay_ranks_supported) == (
        LoopMetrics({}), False, None)
    loop.validate_settings(PLAN)
    assert loop.summary({}, Path("run")) is None
    assert {name for name in vars(Loop) if name in HOOKS} == set(HOOKS)  # each declared there


def test_no_module_of_the_app_probes_a_loop_for_a_hook() -> None:
    hook = re.compile("|".join(HOOKS))
    probes = []
    for path in sorted((REPO / "app").rglob("*.py")):
        if path == REPO / "app" / "api.py":  # LoopHooks, the one reader
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and hook.fullmatch(str(node.args[1].value))):
                probes.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert probes == []


def test_no_module_of_the_app_reads_a_loop_setting_by_getattr() -> None:
    """The settings the app reads of any loop (``threads``, ``data_parallel``) go through
    ``LoopHooks`` too, with their defaults declared on ``Loop``: no ``getattr(loop, ...)``
    elsewhere (``loop``, ``cfg.loop``, ``job.loop``, ``self.loop``)."""
    assert LoopHooks(Bare()).threads == 0 and LoopHooks(Bare()).data_parallel == "ddp"
    probes = []
    for path in sorted((REPO / "app").rglob("*.py")):
        if path == REPO / "app" / "api.py":  # LoopHooks, the one reader
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args):
                target = node.args[0]
                name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
                if name == "loop":
                    probes.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert probes == []
