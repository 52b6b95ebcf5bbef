"""A replay shard's contents, as ``loop.replay.checkpoint`` saves and restores them
(app/runtime/replay/buffer.py): oldest first, the newest kept when they do not fit, and a
resumed shard samples what it holds."""

from __future__ import annotations

import pytest
import torch

from app.runtime.replay.buffer import Replay, ReplaySettings
from app.runtime.replay.client import LocalReplay

pytestmark = pytest.mark.unit


def segment(start: float, steps: int = 4, envs: int = 2) -> dict[str, torch.Tensor]:
    """A segment whose observations count up from ``start`` (one value per transition)."""
    obs = (start + torch.arange(steps * envs, dtype=torch.float32)).reshape(steps, envs, 1)
    return {"obs": obs, "actions": torch.zeros(steps, envs, dtype=torch.long),
            "rewards": torch.ones(steps, envs), "dones": torch.zeros(steps, envs),
            "next_obs": torch.zeros(envs, 1), "next_done": torch.zeros(envs)}


def shard(capacity: int) -> Replay:
    return Replay(ReplaySettings(capacity=capacity, batch_size=4, min_size=0), {}, 0.99)


def held(replay: Replay) -> list[float]:
    return replay.contents()["transitions"]["obs"].flatten().tolist()


def test_contents_are_the_held_transitions_oldest_first_even_after_wrapping() -> None:
    replay = shard(capacity=10)
    for start in (0.0, 8.0):  # 16 transitions into 10 slots: 6..15 remain
        replay.insert(segment(start))
    assert held(replay) == [float(v) for v in range(6, 16)]
    again = shard(capacity=10)
    again.restore([replay.contents()])
    assert held(again) == held(replay) and again.size == 10
    again.insert(segment(16.0, steps=1))  # the two oldest go first
    assert held(again) == [float(v) for v in range(8, 18)]


def test_shards_dealt_to_one_keep_the_newest_that_fit() -> None:
    first, second = shard(capacity=8), shard(capacity=8)
    first.insert(segment(0.0))
    second.insert(segment(100.0))
    joined = shard(capacity=12)
    joined.restore([first.contents(), second.contents()])
    assert held(joined) == [float(v) for v in range(4, 8)] + [100.0 + v for v in range(8)]


def test_a_resumed_shard_samples_what_it_holds_not_empty_slots() -> None:
    """A shard resumed with the run's counters (inserts far past capacity) and refilled from
    empty samples its new transitions: before, it wrote them at inserts mod capacity and
    sampled slots [0, size), zeros."""
    replay = shard(capacity=100)
    replay.load_state_dict({"inserts": 1234, "samples": 0, "max_priority": 1.0})
    replay.insert(segment(1.0))
    batch = replay.sample(torch.Generator().manual_seed(0))
    assert replay.size == 8 and bool((batch.obs >= 1.0).all()), batch.obs.flatten().tolist()


def test_a_restored_trainer_shard_counts_on_as_its_limiter_did() -> None:
    settings = ReplaySettings(capacity=64, batch_size=4, min_size=16, samples_per_insert=1.0,
                              tolerance=8.0)
    before = LocalReplay(settings, {}, 0.99)
    before.share_among(1)
    for start in range(0, 32, 8):
        before.insert(segment(float(start)))
    assert before.steps_allowed() > 0
    saved, contents = before.state_dict(), before.contents()
    cold = LocalReplay(settings, {}, 0.99)
    cold.load_state_dict(saved)
    cold.share_among(1)
    cold.insert(segment(100.0))
    assert cold.steps_allowed() == 0  # without its contents: a fresh warm-up
    warm = LocalReplay(settings, {}, 0.99)
    warm.load_state_dict(saved)
    warm.restore([contents])
    warm.share_among(1)
    assert warm.size == 32 and warm.steps_allowed() == before.steps_allowed()
