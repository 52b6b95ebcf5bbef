"""Self-checks for the single-process PPO building blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.loops.ppo.core import (
    ActorCritic,
    PPOHyperParams,
    Rollout,
    RolloutWorker,
    compute_gae,
    make_optimizer,
    ppo_update,
    set_lr,
)

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Multi-threaded BLAS reductions may reorder float sums; one thread is bitwise reproducible.
    torch.set_num_threads(1)


def _train(
    seed: int, updates: int, hp: PPOHyperParams
) -> tuple[ActorCritic, list[tuple[float, int]]]:
    """Single-worker PPO run; returns the policy and all finished episodes in order."""
    torch.manual_seed(seed)
    worker = RolloutWorker.from_hparams(hp, seed)
    policy = ActorCritic(worker.obs_dim, 2, hp.hidden_size)
    optimizer = make_optimizer(policy, hp)
    generator = torch.Generator().manual_seed(seed)
    episodes: list[tuple[float, int]] = []
    for update in range(updates):
        set_lr(optimizer, hp, update * hp.num_envs * hp.num_steps)
        rollout, finished = worker.collect(policy, hp.num_steps)
        episodes += finished
        ppo_update(policy, policy, optimizer, [rollout], hp, generator)
    worker.close()
    return policy, episodes


def test_flat_tensor_round_trip_is_exact() -> None:
    hp = PPOHyperParams(num_envs=3, num_steps=20)
    worker = RolloutWorker.from_hparams(hp, seed=0)
    rollout, _ = worker.collect(ActorCritic(worker.obs_dim, 2), hp.num_steps)
    flat = rollout.to_flat_tensor()

    assert flat.dtype == torch.float32 and flat.dim() == 1 and flat.is_contiguous()
    assert flat.numel() == Rollout.flat_size(hp.num_steps, hp.num_envs, worker.obs_dim)
    back = Rollout.from_flat_tensor(flat.clone(), hp.num_steps, hp.num_envs, worker.obs_dim)
    for field in dataclasses.fields(Rollout):
        original, restored = getattr(rollout, field.name), getattr(back, field.name)
        assert restored.dtype == original.dtype, field.name
        assert torch.equal(restored, original), field.name
    assert torch.equal(back.to_flat_tensor(), flat)


def test_from_flat_tensor_rejects_wrong_size() -> None:
    with pytest.raises(ValueError):
        Rollout.from_flat_tensor(torch.zeros(10), num_steps=2, num_envs=2, obs_dim=4)


def test_gae_matches_hand_computation() -> None:
    # One env, 3 steps; an episode ends after step 1 (so obs[2] starts a new one).
    gamma, lam = 0.9, 0.5
    r = [1.0, 2.0, 3.0]
    v = [0.5, 1.0, 1.5]
    next_value = 2.0
    rollout = Rollout(
        obs=torch.zeros(3, 1, 4),
        actions=torch.zeros(3, 1, dtype=torch.long),
        logprobs=torch.zeros(3, 1),
        rewards=torch.tensor(r).view(3, 1),
        dones=torch.tensor([0.0, 0.0, 1.0]).view(3, 1),
        values=torch.tensor(v).view(3, 1),
        next_obs=torch.zeros(1, 4),
        next_done=torch.zeros(1),
    )
    # By hand: deltas, then backwards accumulation cut at the episode boundary.
    d2 = r[2] + gamma * next_value - v[2]  # 3 + 1.8 - 1.5 = 3.3
    d1 = r[1] + 0.0 - v[1]  # terminal: 2 - 1 = 1.0
    d0 = r[0] + gamma * v[1] - v[0]  # 1 + 0.9 - 0.5 = 1.4
    a2 = d2
    a1 = d1  # no bootstrap through the boundary
    a0 = d0 + gamma * lam * a1  # 1.4 + 0.45 = 1.85
    advantages, returns = compute_gae(rollout, torch.tensor([next_value]), gamma, lam)

    torch.testing.assert_close(advantages.view(-1), torch.tensor([a0, a1, a2]))
    torch.testing.assert_close(returns.view(-1), torch.tensor([a0 + v[0], a1 + v[1], a2 + v[2]]))


def test_short_training_improves_return() -> None:
    hp = PPOHyperParams(anneal_env_steps=30_000)  # anneal over this short run
    updates = 30_000 // (hp.num_envs * hp.num_steps) + 1  # ~30k env steps
    _, episodes = _train(seed=0, updates=updates, hp=hp)
    returns = [r for r, _ in episodes]
    first, last = sum(returns[:20]) / 20, sum(returns[-20:]) / 20

    # A random CartPole policy scores ~20; a learning one is far above that.
    assert first < 50
    # Seeds 0-5 give 160-300 here; 100 leaves room for platform-dependent float drift.
    assert last > 100 and last > 4 * first, (first, last)


def test_same_seed_gives_identical_parameters() -> None:
    hp = PPOHyperParams(num_envs=4, num_steps=32)
    a, episodes_a = _train(seed=3, updates=3, hp=hp)
    b, episodes_b = _train(seed=3, updates=3, hp=hp)

    assert episodes_a == episodes_b
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
