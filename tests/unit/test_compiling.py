"""``loop.compile`` (app/runtime/core/compiling.py): the modes it takes, what it refuses before launch,
the compiled PPO minibatch loss against the written one, and the one-line error naming the
setting when a step cannot compile (docs/off-policy.md, "Learner speed")."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from app.runtime.core import compiling
from app.runtime.core.compiling import CompileError, compile_problem, compiled
from benchmarks.learner_step import PPOLearner

pytestmark = pytest.mark.unit


def test_off_is_the_function_itself_and_unknown_modes_are_named() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    assert compiled(step, "off", "a step") is step
    assert compile_problem("off") is None
    assert compile_problem("max") == "must be one of off, inductor, cpp_wrapper, got 'max'"


def test_without_a_cpp_compiler_inductor_is_refused_before_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    problem = compile_problem("inductor")
    assert problem is not None and "needs a C++ compiler" in problem
    assert compile_problem("off") is None


def test_a_step_that_cannot_compile_is_one_error_naming_the_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(fn: Any, **kwargs: Any) -> Any:
        def call(*args: Any) -> Any:
            raise torch._dynamo.exc.Unsupported("data-dependent control flow")
        return call

    monkeypatch.setattr(torch, "compile", failing)
    step = compiled(lambda x: x, "inductor", "PPO's minibatch loss")
    with pytest.raises(CompileError, match=r"^loop.compile=inductor: PPO's minibatch loss cannot "
                       r"be compiled \(Unsupported: data-dependent control flow\); set "
                       r"loop.compile=off$"):
        step(torch.ones(1))


def test_the_compiled_ppo_minibatch_loss_is_the_written_one_to_rounding() -> None:
    eager, inductor = PPOLearner("off"), PPOLearner("inductor")
    for learner in (eager, inductor):
        learner.step()
        learner.step()
    for (name, a), b in zip(eager.net.named_parameters(), inductor.net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    loss, figures = inductor.ppo.loss_fn(inductor.net, inductor.batch, inductor.settings)
    want, want_figures = eager.ppo.loss_fn(eager.net, eager.batch, eager.settings)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert figures.keys() == want_figures.keys()
