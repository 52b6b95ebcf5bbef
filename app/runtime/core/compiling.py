"""``loop.compile``: an algorithm's update step as one compiled function (``torch.compile``,
Inductor on the CPU), or as it is written (``off``, the default).

An algorithm wraps the pure part of its step (forward passes and losses; autograd then runs the
compiled backward) with :func:`compiled`; the optimizer's step stays PyTorch's fused Adam. The
first call compiles (seconds to tens of seconds: part of the run's wall time); a function that
cannot compile raises :class:`CompileError`, naming the setting and the function, rather than
falling back quietly. What each mode measured on the learner step:
docs/off-policy.md, "Learner speed".
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from typing import Any, TypeVar

import torch

# off: eager; inductor: Inductor's C++/OpenMP kernels behind its Python wrapper; cpp_wrapper:
# the same kernels called from a C++ wrapper (less Python per call).
COMPILE_MODES = ("off", "inductor", "cpp_wrapper")

F = TypeVar("F", bound=Callable[..., Any])


class CompileError(RuntimeError):
    """A step that ``loop.compile`` asked to compile and that torch.compile could not."""


def compile_problem(mode: str) -> str | None:
    """Why ``mode`` cannot work here (checked before launch), or None."""
    if mode not in COMPILE_MODES:
        return f"must be one of {', '.join(COMPILE_MODES)}, got {mode!r}"
    if mode != "off" and shutil.which("c++") is None and shutil.which("g++") is None:
        return (f"{mode} needs a C++ compiler for Inductor's CPU kernels (c++ or g++ on PATH); "
                "none found, set loop.compile=off")
    return None


def compiled(fn: F, mode: str, what: str) -> F:
    """``fn`` compiled as ``mode`` says (``fn`` itself when ``off``). A failure to compile it
    raises :class:`CompileError` naming ``what`` (e.g. ``"SAC's Q step"``)."""
    if mode == "off":
        return fn
    problem = compile_problem(mode)
    if problem:
        raise CompileError(f"loop.compile: {problem}")
    options: dict[str, str | int | bool | Callable[..., Any]] = (
        {"cpp_wrapper": True} if mode == "cpp_wrapper" else {})
    # Shapes are fixed per run (the batch, the minibatch): no dynamic-shape guards.
    step = torch.compile(fn, backend="inductor", dynamic=False, options=options)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return step(*args, **kwargs)
        except Exception as err:
            if not isinstance(err, torch._dynamo.exc.TorchDynamoException):
                raise  # the step's own error, compiled or not
            raise CompileError(f"loop.compile={mode}: {what} cannot be compiled "
                               f"({type(err).__name__}: {str(err).splitlines()[0]}); "
                               "set loop.compile=off") from err

    return call  # type: ignore[return-value]
