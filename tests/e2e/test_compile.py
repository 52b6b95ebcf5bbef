"""``loop.compile`` through the app: PPO's compiled minibatch loss runs through DDP on two
trainers (the default layout) and the run ends with every update done and finite losses
(docs/off-policy.md, "Learner speed")."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers.apprun import metrics, run_ppo

pytestmark = pytest.mark.e2e


def test_ppo_compiled_through_ddp_on_2t2r_trains_every_update(tmp_path: Path) -> None:
    result = run_ppo(tmp_path, "layout=2t2r", "loop.compile=cpp_wrapper",
                     "loop.hparams.num_envs=4", "loop.hparams.num_steps=64",
                     "loop.total_env_steps=2048", "loop.checkpoint_every=0")
    trainers = [r["result"] for r in result["ranks"] if r["role"].startswith("trainer")]
    assert len(trainers) == 2 and {t["updates"] for t in trainers} == {4}
    rows = metrics(tmp_path)
    assert len(rows) == 4
    assert all(math.isfinite(r["pg_loss"]) and math.isfinite(r["v_loss"]) for r in rows)
