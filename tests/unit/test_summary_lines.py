"""The closing summary's first line (app/output/summary.py): solved, not solved, and an
evaluation that reached the target after the last update (docs/evaluate.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.output.summary import format_summary, run_summary

pytestmark = pytest.mark.unit


def _summary(solved: bool, last_eval: float | None) -> dict[str, Any]:
    evaluation = (None if last_eval is None else
                  {"return_mean": last_eval, "return_std": 0.0, "version": 265, "update": 265})
    return run_summary("ppo", 1, 0, 99.7, Path("/tmp/run"), {
        "solved": solved, "target_return": 500.0, "window": 20, "final_mean_return": 500.0,
        "stop_on": "eval", "eval": evaluation, "eval_episodes": 10, "best_checkpoint": None,
        "env_steps": 400_384, "time_to_target_s": 50.0 if solved else None,
        "env_steps_to_target": 200_000 if solved else None, "env_steps_per_s": 4158.0,
        "transfer_share": 0.0})


def _first(summary: dict[str, Any]) -> str:
    return format_summary(summary).splitlines()[1]


def test_a_last_evaluation_at_the_target_after_the_last_update_is_named_as_such() -> None:
    assert _first(_summary(False, 500.0)) == (
        "not solved within the budget: the evaluation of weights v265 reached 500.0 (target "
        "500) after the last update; the budget of 400,384 env steps ended the run")


def test_below_the_target_and_solved_read_as_before() -> None:
    assert _first(_summary(False, 441.4)) == (
        "not solved: mean return of an evaluation (10 episodes) is 441.4, target 500; the "
        "budget of 400,384 env steps ended the run")
    assert _first(_summary(True, 500.0)).startswith(
        "solved: mean return of an evaluation (10 episodes) reached 500 after 50.0 s")
