"""A SAC run checkpoints and resumes as a user runs it (``loop=sac layout=single``, tiny
settings): the checkpoint holds the target networks, log alpha and its Adam, the learner's steps
and the replay's counters; the resumed run restores all of them, refills its replay to
``min_size`` before the learner steps again, and goes on learning from the alpha it left
(docs/off-policy.md)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from app.runtime.checkpoints.checkpoint import load_checkpoint
from tests.helpers.apprun import describe, metrics, run_app

pytestmark = pytest.mark.e2e

MIN_SIZE = 256
# 4 envs x 8 steps: 32 transitions per update; 32-32 networks, a batch of 64 per 4 inserts.
TINY = ("loop=sac", "layout=single", "seed=1", "loop.progress=false",
        "loop.hparams.hidden_sizes=[32,32]", "loop.replay.batch_size=64",
        "loop.replay.samples_per_insert=16", "loop.replay.tolerance=64",
        f"loop.replay.min_size={MIN_SIZE}")


def _equal(a: Any, b: Any) -> bool:
    """Nested state (dicts, lists, tensors, numbers) equal exactly."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


def test_a_sac_run_resumes_its_targets_alpha_adam_and_replay_counters(tmp_path: Path) -> None:
    first = run_app(*TINY, "loop.total_env_steps=1024", "loop.checkpoint_every=8",
                    f"hydra.run.dir={tmp_path / 'a'}")
    assert first.returncode == 0, describe(first)
    before = metrics(tmp_path / "a")[-1]
    saved = load_checkpoint(tmp_path / "a" / "checkpoints" /
                            f"ckpt_{int(before['update']):06d}.pt")
    own = saved["algorithm"]
    policy = saved["policy"]
    # What resuming needs: the targets (in the module), alpha and its Adam, the counters.
    assert {k for k in policy if k.startswith(("q1_target.", "q2_target."))}
    assert not torch.equal(policy["q1_target.0.weight"], policy["q1.0.weight"])
    assert own["replay"]["inserts"] == before["replay_inserts"] == 1024
    assert own["replay"]["samples"] == before["replay_samples"] > 0
    assert own["learner_steps"] > 0 and own["alpha_optimizer"]["state"]
    assert torch.equal(policy["log_alpha"], own["log_alpha"])  # the module's copy
    # metrics.csv's alpha is the update's mean over its learner steps.
    assert math.exp(float(own["log_alpha"])) == pytest.approx(before["alpha"], rel=0.02)
    assert before["alpha"] < 0.99  # tuned away from its start (1), so a reset would show

    second = run_app(*TINY, "loop.total_env_steps=1536", "loop.checkpoint_every=1",
                     "loop.checkpoint_keep=100",  # every one kept: the first is read below
                     f"loop.resume={tmp_path / 'a'}", f"hydra.run.dir={tmp_path / 'b'}")
    assert second.returncode == 0, describe(second)
    rows = metrics(tmp_path / "b")
    # The first resumed update only refills: its checkpoint is the saved state, restored, with
    # one segment more inserted.
    after = load_checkpoint(tmp_path / "b" / "checkpoints" /
                            f"ckpt_{int(before['update']) + 1:06d}.pt")
    for name in ("policy", "optimizer"):
        assert _equal(after[name], saved[name]), name
    assert _equal(after["algorithm"]["log_alpha"], own["log_alpha"])
    assert _equal(after["algorithm"]["alpha_optimizer"], own["alpha_optimizer"])
    assert after["algorithm"]["learner_steps"] == own["learner_steps"]
    assert after["algorithm"]["replay"]["inserts"] == own["replay"]["inserts"] + 32
    assert after["algorithm"]["replay"]["samples"] == own["replay"]["samples"]
    # The replay refills to min_size (8 segments of 32) before the learner steps again.
    refill = MIN_SIZE // 32
    assert [r["learner_wait"] for r in rows[:refill - 1]] == [1.0] * (refill - 1)
    assert [r["replay_size"] for r in rows[:3]] == [32.0, 64.0, 96.0]
    learnt = [r for r in rows if r["learner_steps"] > 0]
    assert learnt and learnt[0]["replay_size"] >= MIN_SIZE
    assert rows[-1]["replay_samples"] > own["replay"]["samples"]
    # Alpha goes on from where it was (a few Adam steps of 1e-3 on log alpha), not from 1.
    assert learnt[0]["alpha"] == pytest.approx(before["alpha"], rel=0.1)
