"""Self-checks for PPO on the runtime's single-process pieces: a worker collecting segments, the
packed segment's round trip, GAE, and the same parameters from the same seed. A short training
run that learns is tests/integration/test_single_process_learning.py."""

from __future__ import annotations

import pytest
import torch

from app.loops.ppo.core import PPOSettings, compute_gae
from app.runtime import Segment
from app.runtime.core.segments import Field, SegmentFormat
from app.runtime.rollout.worker import as_segment
from tests.helpers.single_process import ppo_parts, train_ppo

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Multi-threaded BLAS reductions may reorder float sums; one thread is bitwise reproducible.
    torch.set_num_threads(1)


def test_a_packed_segment_round_trips_exactly_with_every_dtype() -> None:
    segment_format = SegmentFormat({"a": Field((3, 2), torch.float32), "b": Field((5,), torch.uint8),
                                    "c": Field((2, 2), torch.int64), "d": Field((1,), torch.float64)})
    values = {"a": torch.randn(3, 2), "b": torch.arange(5, dtype=torch.uint8),
              "c": torch.tensor([[1, -2], [3, 2**40]]), "d": torch.tensor([1 / 3], dtype=torch.float64)}
    packed = segment_format.pack(values)
    assert packed.dtype == torch.uint8 and packed.numel() == segment_format.nbytes
    back = segment_format.unpack(packed.clone())
    for name, value in values.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name
    with pytest.raises(ValueError, match="uint8 bytes"):
        segment_format.unpack(torch.zeros(segment_format.nbytes + 1, dtype=torch.uint8))


def test_a_collected_segment_holds_every_step_and_its_version() -> None:
    settings = PPOSettings(num_envs=3, num_steps=20)
    _, agent, worker = ppo_parts(0, settings)
    packed, _ = worker.collect(agent, version=7)
    segment = as_segment(worker.segment_format, packed)
    worker.close()
    assert segment.version == 7 and segment.lag == 0
    assert segment["obs"].shape == (20, 3, 4) and segment["actions"].dtype == torch.int64
    assert set(segment["actions"].unique().tolist()) <= {0, 1}
    assert segment["logprobs"].shape == segment["values"].shape == (20, 3)
    assert segment["next_obs"].shape == (3, 4) and segment["next_done"].shape == (3,)
    assert float(segment["rewards"].sum()) >= 60  # CartPole pays 1 per step (plus bootstraps)


def test_gae_matches_hand_computation() -> None:
    # One env, 3 steps; an episode ends after step 1 (so obs[2] starts a new one).
    gamma, lam = 0.9, 0.5
    r = [1.0, 2.0, 3.0]
    v = [0.5, 1.0, 1.5]
    next_value = 2.0
    segment = Segment(
        rewards=torch.tensor(r).view(3, 1),
        dones=torch.tensor([0.0, 0.0, 1.0]).view(3, 1),
        values=torch.tensor(v).view(3, 1),
        next_done=torch.zeros(1),
    )
    # By hand: deltas, then backwards accumulation cut at the episode boundary.
    d2 = r[2] + gamma * next_value - v[2]  # 3 + 1.8 - 1.5 = 3.3
    d1 = r[1] + 0.0 - v[1]  # terminal: 2 - 1 = 1.0
    d0 = r[0] + gamma * v[1] - v[0]  # 1 + 0.9 - 0.5 = 1.4
    a2 = d2
    a1 = d1  # no bootstrap through the boundary
    a0 = d0 + gamma * lam * a1  # 1.4 + 0.45 = 1.85
    advantages, returns = compute_gae(segment, torch.tensor([next_value]), gamma, lam)

    torch.testing.assert_close(advantages.view(-1), torch.tensor([a0, a1, a2]))
    torch.testing.assert_close(returns.view(-1), torch.tensor([a0 + v[0], a1 + v[1], a2 + v[2]]))


def test_same_seed_gives_identical_parameters() -> None:
    settings = PPOSettings(num_envs=4, num_steps=32)
    a, episodes_a = train_ppo(seed=3, updates=3, settings=settings)
    b, episodes_b = train_ppo(seed=3, updates=3, settings=settings)

    assert episodes_a == episodes_b
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
