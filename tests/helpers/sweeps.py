"""What the sweep tests share (tests/unit/test_sweeps.py, tests/e2e/test_sweeps.py): the PPO loop
and the metrics every PPO job reports, and a plugged-in loop with a metric of its own."""

from __future__ import annotations

from pathlib import Path

PNG = b"\x89PNG\r\n\x1a\n"  # how every PNG file starts
PPO = "app.loops.ppo.PPOLoop"
# What every PPO job's result.json holds.
PPO_METRICS = {
    "env_steps_per_s", "time_to_target_s", "env_steps_to_target", "reached_target",
    "updates_per_s", "transfer_s", "transfer_share", "trainer_wait_fraction",
    "rollout_wait_fraction", "final_mean_return", "startup_s", "group_creation_s", "wall_s",
    "eval_return_mean", "best_eval_return",  # None without evaluations (loop.eval_every)
}
# A plugged-in loop with a figure of its own (``scored_loop`` installs it).
SCORED_LOOP = '''
from dataclasses import dataclass
from typing import ClassVar

from app.api import LoopMetrics, setting


@dataclass
class Scored:
    """A loop with a figure of its own that no shipped loop reports: higher ``score`` is better."""

    scale: float = setting(1.0, "the score this job reports")

    metrics: ClassVar[LoopMetrics] = LoopMetrics({"score": "max"}, headline=("score",))

    def __call__(self, ctx, job):
        return {"metrics": {"score": self.scale}}
'''
SCORED_KNOWN = "known: group_creation_s, score, startup_s, wall_s"  # its own and the app's


def scored_loop(tmp_path: Path, package: str) -> str:
    """The loop above as ``<package>.loops`` under ``tmp_path``; returns its ``_target_``."""
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "loops.py").write_text(SCORED_LOOP)
    return f"{package}.loops.Scored"
