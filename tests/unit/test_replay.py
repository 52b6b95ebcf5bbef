"""The replay shard and its rate limiter (app/runtime/replay/buffer.py): n-step returns against a hand
computation, FIFO eviction, prioritized sampling against its distribution, importance weights,
the settings' range checks and the limiter's ratio with a fast and a slow side."""

from __future__ import annotations

import pytest
import torch

from app.runtime.core.algorithm import Record, Segment
from app.runtime.replay.buffer import RateLimiter, Replay, ReplaySettings

pytestmark = pytest.mark.unit


def _segment(rewards: list[list[float]], dones: list[list[float]], next_done: list[float],
             first_obs: float = 0.0) -> Segment:
    """A [T, N] segment whose observation is its global step index (first_obs + t), per env."""
    r = torch.tensor(rewards)
    steps, envs = r.shape
    obs = (first_obs + torch.arange(steps, dtype=torch.float32))[:, None, None].expand(
        steps, envs, 1).clone()
    return Segment(obs=obs, actions=torch.zeros(steps, envs, dtype=torch.int64), rewards=r,
                   dones=torch.tensor(dones), next_obs=torch.full((envs, 1), first_obs + steps),
                   next_done=torch.tensor(next_done), extra=torch.arange(steps * envs,
                                                                       dtype=torch.float32
                                                                       ).reshape(steps, envs))


def _settings(**overrides: object) -> ReplaySettings:
    base: dict[str, object] = dict(capacity=100, batch_size=4, min_size=0, samples_per_insert=1.0,
                                   tolerance=4.0, n_step=1)
    base.update(overrides)
    return ReplaySettings(**base)  # type: ignore[arg-type]


def test_n_step_returns_match_a_hand_computation_with_an_episode_end_inside() -> None:
    gamma = 0.9
    # One env, 5 steps; obs[3] starts a new episode, so step 2 ended one.
    seg = _segment([[1.0], [2.0], [3.0], [4.0], [5.0]], [[0], [0], [0], [1], [0]], [0.0])
    replay = Replay(_settings(n_step=3), {}, gamma)
    assert replay.insert(seg) == 5
    s = replay.storage
    want_rewards = [1 + gamma * 2 + gamma**2 * 3,  # t=0: steps 0..2, the episode ends at 2
                    2 + gamma * 3,  # t=1: steps 1, 2, then the end
                    3.0,  # t=2: the last step of its episode
                    4 + gamma * 5,  # t=3: steps 3, 4, then the segment ends
                    5.0]  # t=4: one step, bootstrapped from next_obs
    want_discounts = [0.0, 0.0, 0.0, gamma**2, gamma]
    # Where the discount is 0 the next observation is never used; else it is the one reached.
    assert torch.allclose(s["rewards"][:5], torch.tensor(want_rewards))
    assert torch.allclose(s["discounts"][:5], torch.tensor(want_discounts))
    assert s["next_obs"][3:5, 0].tolist() == [5.0, 5.0]  # next_obs, after the segment


def test_n_step_transitions_bootstrap_from_the_observation_n_steps_later() -> None:
    gamma = 0.5
    seg = _segment([[1.0]] * 6, [[0.0]] * 6, [0.0])  # one episode through the segment
    replay = Replay(_settings(n_step=2), {}, gamma)
    replay.insert(seg)
    s = replay.storage
    assert s["next_obs"][:6, 0].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 6.0]  # 6: next_obs
    assert s["rewards"][:6].tolist() == [1.5] * 5 + [1.0]
    assert s["discounts"][:6].tolist() == [0.25] * 5 + [0.5]


def test_one_step_transitions_bootstrap_from_the_next_observation() -> None:
    seg = _segment([[1.0, 1.0], [1.0, 1.0]], [[0, 0], [0, 1]], [1.0, 0.0])
    replay = Replay(_settings(), {"extra": Record()}, 0.5)
    replay.insert(seg)
    s = replay.storage
    # Time-major flattening: slot = t * N + i. Env 1 ended at step 0, env 0 at step 1.
    assert s["discounts"][:4].tolist() == [0.5, 0.0, 0.0, 0.5]
    assert s["next_obs"][:4, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
    assert s["extra"][:4].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_the_oldest_transitions_are_evicted_first() -> None:
    replay = Replay(_settings(capacity=7, batch_size=2), {}, 0.9)
    for first in (0.0, 3.0, 6.0):  # 3 steps x 1 env each: 9 inserted into 7 slots
        replay.insert(_segment([[0.0]] * 3, [[0.0]] * 3, [0.0], first_obs=first))
    assert (replay.size, replay.inserts) == (7, 9)
    assert sorted(replay.storage["obs"][:, 0].tolist()) == [2, 3, 4, 5, 6, 7, 8]
    # A segment larger than the shard keeps its newest transitions.
    replay.insert(_segment([[0.0]] * 10, [[0.0]] * 10, [0.0], first_obs=100.0))
    assert sorted(replay.storage["obs"][:, 0].tolist()) == list(range(103, 110))


def test_prioritized_sampling_matches_its_distribution() -> None:
    alpha, beta = 0.6, 0.4
    replay = Replay(_settings(capacity=8, batch_size=1000, prioritized=True, n_step=1,
                              priority_exponent=alpha, importance_exponent=beta), {}, 0.9)
    replay.insert(_segment([[0.0]] * 8, [[0.0]] * 8, [0.0]))
    priorities = torch.tensor([0.1, 0.5, 1.0, 2.0, 3.0, 0.2, 4.0, 1.5])
    replay.update_priorities(torch.arange(8), priorities)
    want = (priorities.double() + 1e-6) ** alpha
    want /= want.sum()
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(8, dtype=torch.float64)
    weights_seen: dict[int, float] = {}
    for _ in range(40):
        batch = replay.sample(generator)
        counts += torch.bincount(batch.indices, minlength=8).double()
        weights_seen.update(zip(batch.indices.tolist(), batch.weights.tolist(), strict=True))
    draws = counts.sum()
    chi_square = float(((counts - draws * want) ** 2 / (draws * want)).sum())
    assert chi_square < 24.3, (chi_square, counts)  # 7 degrees of freedom, p = 0.001
    # Importance weights: (N P(i))^-beta over their largest, the rarest slot's.
    expected = (8 * want) ** -beta / ((8 * want.min()) ** -beta)
    for slot, weight in weights_seen.items():
        assert weight == pytest.approx(float(expected[slot]), rel=1e-5)
    assert max(weights_seen.values()) <= 1.0 + 1e-6
    assert replay.priority_spread() > 0
    assert replay.samples == 40 * 1000


def test_new_transitions_get_the_largest_priority_seen() -> None:
    replay = Replay(_settings(capacity=8, prioritized=True, priority_exponent=1.0), {}, 0.9)
    replay.insert(_segment([[0.0]] * 4, [[0.0]] * 4, [0.0]))
    replay.update_priorities(torch.tensor([0, 1]), torch.tensor([5.0, 0.5]))
    replay.insert(_segment([[0.0]] * 2, [[0.0]] * 2, [0.0]))
    assert replay.priorities[4:6].tolist() == pytest.approx([5.0 + 1e-6] * 2)


def test_uniform_sampling_has_unit_weights_and_counts_its_samples() -> None:
    replay = Replay(_settings(), {"extra": Record()}, 0.9)
    replay.insert(_segment([[0.0]] * 10, [[0.0]] * 10, [0.0]))
    batch = replay.sample(torch.Generator().manual_seed(0))
    assert batch.weights.tolist() == [1.0] * 4 and batch.extras["extra"].shape == (4,)
    assert int(batch.indices.max()) < 10 and replay.samples == 4
    restored = Replay(_settings(), {}, 0.9)
    restored.load_state_dict(replay.state_dict())
    assert (restored.inserts, restored.samples, restored.size) == (10, 4, 0)


@pytest.mark.parametrize(("overrides", "line"), [
    ({"capacity": 64, "batch_size": 128}, "replay.capacity: must be at least batch_size (128), got 64"),
    ({"samples_per_insert": 0.0}, "replay.samples_per_insert: must be > 0, got 0.0"),
    ({"samples_per_insert": -1.0}, "replay.samples_per_insert: must be > 0, got -1.0"),
    ({"n_step": 65}, "replay.n_step: must be in [1, 64] (a segment's steps, hparams.num_steps), got 65"),
    ({"n_step": 0}, "replay.n_step: must be in [1, 64] (a segment's steps, hparams.num_steps), got 0"),
    ({"tolerance": 1.0}, "replay.tolerance: must be at least (batch_size + samples_per_insert) / 2 = 2.5"),
    ({"priority_exponent": 1.5}, "replay.priority_exponent: must be in [0, 1], got 1.5"),
    ({"min_size": 200}, "replay.min_size: must be at most capacity (100), got 200"),
])
def test_settings_out_of_range_name_the_field_and_value(overrides: dict[str, object],
                                                        line: str) -> None:
    errors = _settings(**overrides).range_errors(segment_steps=64)
    assert errors and errors[0].startswith(line), errors
    assert _settings().range_errors(segment_steps=64) == []


@pytest.mark.parametrize(("per_tick_inserts", "max_steps_per_tick"), [(64, 1), (4, 50)],
                         ids=["fast collector, slow learner", "slow collector, fast learner"])
def test_the_limiter_holds_the_ratio_within_tolerance(per_tick_inserts: int,
                                                      max_steps_per_tick: int) -> None:
    spi, tol, batch, min_size = 2.0, 40.0, 32, 100
    limiter = RateLimiter(spi, tol, min_size, batch)
    inserts = samples = 0
    collector_waits = learner_waits = 0
    for _ in range(3000):
        room = limiter.inserts_allowed(inserts, samples)
        granted = min(per_tick_inserts, room)
        collector_waits += granted < per_tick_inserts
        inserts += granted
        steps = min(limiter.steps_allowed(inserts, samples, size=inserts), max_steps_per_tick)
        learner_waits += steps == 0 and inserts >= min_size
        samples += steps * batch
        if inserts >= min_size:
            drift = samples - limiter.target(inserts)
            assert -tol - spi <= drift <= tol, (inserts, samples, drift)
    assert inserts > 1000
    ratio = samples / (inserts - min_size)
    assert abs(ratio - spi) <= (tol + spi) / (inserts - min_size), ratio
    # The slow side's partner waited, and it was recorded.
    if max_steps_per_tick == 1:
        assert collector_waits > 0
    else:
        assert learner_waits > 0


def test_a_truncated_episode_bootstraps_from_its_final_observation_a_terminated_one_not() -> None:
    """Two envs, 4 steps, n_step=3: env 0's episode is cut by a time limit after step 1 (its
    true last observation, 100, is in final_obs; obs[2] is the reset one), env 1's terminates
    after step 1. Hand computation of every transition's sum, discount and next observation."""
    gamma = 0.5
    seg = _segment([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]],
                   [[0, 0], [0, 0], [1, 1], [0, 0]], [0.0, 0.0])
    seg["truncated"] = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    final = torch.zeros(4, 2, 1)
    final[1, 0] = 100.0
    seg["final_obs"] = final
    replay = Replay(_settings(n_step=3), {}, gamma)
    replay.insert(seg)
    s = replay.storage
    rewards, discounts = s["rewards"][:8].view(4, 2), s["discounts"][:8].view(4, 2)
    next_obs = s["next_obs"][:8, 0].view(4, 2)
    # env 0 (truncated at step 1): t=0 sums steps 0, 1 and bootstraps from 100 with gamma^2;
    # t=1 one step, gamma^1 from 100; t=2 steps 2, 3 then the segment's next_obs (4) at gamma^2.
    assert rewards[:, 0].tolist() == [1 + gamma * 2, 2.0, 3 + gamma * 4, 4.0]
    assert discounts[:, 0].tolist() == [gamma**2, gamma, gamma**2, gamma]
    assert next_obs[:3, 0].tolist() == [100.0, 100.0, 4.0]
    # env 1 (terminated at step 1): the same sums, no bootstrap for t=0, 1.
    assert rewards[:, 1].tolist() == rewards[:, 0].tolist()
    assert discounts[:, 1].tolist() == [0.0, 0.0, gamma**2, gamma]
