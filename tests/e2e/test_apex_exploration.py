"""``loop.hparams.exploration=apex`` as a user runs it: each rollout rank learns its index among
the collectors and explores with Ape-X's epsilon for it, said in its log (docs/off-policy.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.loops.dqn import apex_epsilon
from tests.helpers.apprun import describe, read_result, run_app

pytestmark = pytest.mark.e2e


def test_each_rollout_rank_explores_with_its_own_apex_epsilon(tmp_path: Path) -> None:
    proc = run_app("loop=dqn", "layout=1t3r", "seed=1", "loop.progress=false",
                   "loop.checkpoint_every=0", "loop.total_env_steps=1536",
                   "loop.replay.min_size=256", "loop.hparams.exploration=apex",
                   f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    roles = {r["rank"]: r["role"] for r in read_result(tmp_path)["ranks"]}
    rollouts = sorted(rank for rank, role in roles.items() if role == "rollout")
    assert len(rollouts) == 3
    for index, rank in enumerate(rollouts):
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        epsilon = apex_epsilon(0.4, 7.0, index, 3)
        assert f"collector {index} of 3 explores with epsilon {epsilon:.6g}" in log, log[-2000:]
    trainer = (tmp_path / "logs" / "rank0.log").read_text()
    assert "explores with epsilon" not in trainer  # the trainer does not collect
