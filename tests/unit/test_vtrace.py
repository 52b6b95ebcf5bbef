"""V-trace (app/loops/vtrace): its targets against the paper's definition, its settings' checks,
and its update's contract with the runtime. A short single-process run on CartPole that learns
is tests/integration/test_single_process_learning.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces as gym_spaces

from app.loops.vtrace import VTraceLoop
from app.loops.vtrace.core import VTrace, VTraceSettings, discounts_from_dones, vtrace_targets
from app.runtime import Segment, Spaces, UpdateInfo
from app.runtime.core.algorithm import Peers
from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.rollout.worker import Agent, as_segment
from tests.helpers.single_process import vtrace_parts

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    # Multi-threaded BLAS reductions may reorder float sums; one thread is bitwise reproducible.
    torch.set_num_threads(1)


def _random_batch(seed: int, T: int = 9, N: int = 5) -> dict[str, torch.Tensor]:
    """float64 V-trace inputs [T, N] with episode starts and importance ratios on both sides of 1."""
    g = torch.Generator().manual_seed(seed)
    dones = (torch.rand(T, N, generator=g, dtype=torch.float64) < 0.25).double()
    return {
        "behaviour": -torch.rand(T, N, generator=g, dtype=torch.float64) * 2,
        "target": -torch.rand(T, N, generator=g, dtype=torch.float64) * 2,
        "rewards": torch.randn(T, N, generator=g, dtype=torch.float64),
        "values": torch.randn(T, N, generator=g, dtype=torch.float64),
        "bootstrap": torch.randn(N, generator=g, dtype=torch.float64),
        "dones": dones,
        "next_done": (torch.rand(N, generator=g, dtype=torch.float64) < 0.25).double(),
    }


def _paper_vtrace(b: dict[str, torch.Tensor], gamma: float, rho_bar: float, c_bar: float,
                  lam: float) -> tuple[np.ndarray, np.ndarray]:
    """The paper's definition, term by term (no recursion): for each s,
    ``v_s = V(x_s) + sum_{t>=s} (prod_{i=s}^{t-1} gamma_i c_i) delta_t`` with
    ``delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t))``, where ``gamma_t`` is 0 when step t
    ended an episode (``obs[t+1]`` starts a new one) and ``V(x_T)`` is the bootstrap value."""
    behaviour, target = b["behaviour"].numpy(), b["target"].numpy()
    r, V, boot = b["rewards"].numpy(), b["values"].numpy(), b["bootstrap"].numpy()
    dones, next_done = b["dones"].numpy(), b["next_done"].numpy()
    T, N = r.shape
    ratio = np.exp(target - behaviour)
    rho, c = np.minimum(rho_bar, ratio), lam * np.minimum(c_bar, ratio)
    vs, adv = np.zeros((T, N)), np.zeros((T, N))
    for n in range(N):
        V_ext = np.append(V[:, n], boot[n])  # V(x_0), ..., V(x_T)
        ended = [dones[t + 1, n] if t + 1 < T else next_done[n] for t in range(T)]
        disc = [gamma * (1.0 - e) for e in ended]
        delta = [rho[t, n] * (r[t, n] + disc[t] * V_ext[t + 1] - V_ext[t]) for t in range(T)]
        for s in range(T):
            vs[s, n] = V_ext[s] + sum(
                np.prod([disc[i] * c[i, n] for i in range(s, t)]) * delta[t] for t in range(s, T)
            )
        vs_ext = np.append(vs[:, n], boot[n])
        for s in range(T):
            adv[s, n] = rho[s, n] * (r[s, n] + disc[s] * vs_ext[s + 1] - V_ext[s])
    return vs, adv


def _targets(b: dict[str, torch.Tensor], gamma: float, rho_bar: float, c_bar: float,
             lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    discounts = discounts_from_dones(b["dones"], b["next_done"], gamma)
    return vtrace_targets(b["behaviour"], b["target"], b["rewards"], b["values"], b["bootstrap"],
                          discounts, rho_bar, c_bar, lam)


@pytest.mark.parametrize(("rho_bar", "c_bar", "lam"), [(1.0, 1.0, 1.0), (1.5, 0.8, 1.0), (1.0, 1.0, 0.9)])
def test_vtrace_targets_match_the_papers_sum_form_across_episode_boundaries(
        rho_bar: float, c_bar: float, lam: float) -> None:
    for seed in range(3):
        b = _random_batch(seed)
        assert 0 < b["dones"][1:].sum() < b["dones"][1:].numel()  # boundaries, not only
        vs, adv = _targets(b, 0.97, rho_bar, c_bar, lam)
        want_vs, want_adv = _paper_vtrace(b, 0.97, rho_bar, c_bar, lam)
        torch.testing.assert_close(vs, torch.from_numpy(want_vs))
        torch.testing.assert_close(adv, torch.from_numpy(want_adv))


def test_a_step_ends_an_episode_when_the_next_observation_starts_one() -> None:
    dones = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # dones[t]: obs[t] starts one
    next_done = torch.tensor([0.0, 1.0])
    want = 0.9 * torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # 0 where step t ended one
    torch.testing.assert_close(discounts_from_dones(dones, next_done, 0.9), want)


def test_on_policy_targets_are_the_discounted_returns_bootstrapped_at_the_end() -> None:
    b = _random_batch(7)
    b["target"] = b["behaviour"].clone()  # pi = mu: every ratio is 1
    vs, adv = _targets(b, 0.95, rho_bar=1e9, c_bar=1e9)
    discounts = discounts_from_dones(b["dones"], b["next_done"], 0.95)
    returns = torch.zeros_like(vs)
    future = b["bootstrap"]
    for t in reversed(range(vs.shape[0])):  # G_t = r_t + gamma_t G_{t+1}, G_T = V(x_T)
        future = b["rewards"][t] + discounts[t] * future
        returns[t] = future
    torch.testing.assert_close(vs, returns)
    torch.testing.assert_close(adv, returns - b["values"])


def test_rho_bar_truncates_the_importance_weight_and_c_bar_only_the_trace() -> None:
    one = {k: torch.tensor([[v]], dtype=torch.float64) for k, v in
           {"rewards": 1.0, "values": 0.5, "discounts": 0.9}.items()}
    bootstrap = torch.tensor([2.0], dtype=torch.float64)
    delta = 1.0 + 0.9 * 2.0 - 0.5  # the one-step TD error

    def one_step(logratio: float, rho_bar: float, c_bar: float) -> tuple[float, float]:
        target = torch.tensor([[logratio]], dtype=torch.float64)
        vs, adv = vtrace_targets(torch.zeros_like(target), target, one["rewards"], one["values"],
                                 bootstrap, one["discounts"], rho_bar, c_bar)
        return vs.item(), adv.item()

    # pi/mu = e > rho_bar: the weight is rho_bar; c_bar plays no part in a single step.
    for c_bar in (0.1, 1.0, 10.0):
        vs, adv = one_step(1.0, rho_bar=1.0, c_bar=c_bar)
        assert vs == pytest.approx(0.5 + delta) and adv == pytest.approx(delta)
    vs, adv = one_step(1.0, rho_bar=2.0, c_bar=1.0)
    assert vs == pytest.approx(0.5 + 2.0 * delta) and adv == pytest.approx(2.0 * delta)
    # pi/mu = 1/e < rho_bar: the weight is the ratio itself.
    vs, _ = one_step(-1.0, rho_bar=1.0, c_bar=1.0)
    assert vs == pytest.approx(0.5 + np.exp(-1.0) * delta)

    # Over two steps c_bar = 0 cuts the trace: each target is its own one-step correction.
    b = _random_batch(3, T=2, N=4)
    discounts = discounts_from_dones(b["dones"], b["next_done"], 0.9)
    two_step, _ = vtrace_targets(b["behaviour"], b["target"], b["rewards"], b["values"],
                                 b["bootstrap"], discounts, 1.0, 0.0)
    rho = (b["target"] - b["behaviour"]).exp().clamp(max=1.0)
    next_values = torch.cat([b["values"][1:], b["bootstrap"][None]])
    torch.testing.assert_close(
        two_step, b["values"] + rho * (b["rewards"] + discounts * next_values - b["values"]))


def test_settings_range_errors_name_each_bad_field_and_the_minibatch_columns() -> None:
    assert VTraceSettings().range_errors(batch_per_trainer=16 * 64) == []
    errors = VTraceSettings(rho_bar=0.0, trace_lambda=1.5, gamma=0.0, max_grad_norm=-1.0
                            ).range_errors(1024)
    assert errors == ["gamma: must be in (0, 1], got 0.0", "rho_bar: must be > 0, got 0.0",
                      "trace_lambda: must be in [0, 1], got 1.5",
                      "max_grad_norm: must be > 0, got -1.0"]
    # Minibatches split whole env columns: 16 envs x 64 steps give 16 columns, not 1024; so many
    # per segment, whatever number of segments a trainer gets.
    assert VTraceSettings(num_minibatches=16).range_errors(16 * 64) == []
    assert VTraceSettings(num_minibatches=17).range_errors(3 * 16 * 64) == [
        "num_minibatches: must be at most the 16 env columns of a segment (num_envs), got 17"]


def test_the_loop_declares_vtrace_and_its_settings() -> None:
    assert VTraceLoop.algorithm is VTrace
    assert isinstance(VTraceLoop().hparams, VTraceSettings)
    box_actions = Spaces(gym_spaces.Box(-1, 1, (3,)), gym_spaces.MultiBinary(2))
    assert VTrace.space_problem(probe_spaces(EnvConfig())) is None
    assert VTrace.space_problem(box_actions) is not None


def _one_update(seed: int, settings: VTraceSettings) -> tuple[dict[str, float], int, VTrace, Agent]:
    """One update on one real CartPole segment; returns its figures and the optimizer steps."""
    algorithm, agent, worker = vtrace_parts(seed, settings)
    packed, _ = worker.collect(agent, 0)
    worker.close()
    optimizer = algorithm.optimizer(agent.net)
    steps = 0

    def count(*_: object) -> None:
        nonlocal steps
        steps += 1

    optimizer.register_step_post_hook(count)
    info = UpdateInfo(optimizer, torch.Generator().manual_seed(seed), 0, 0, 0)
    torch.manual_seed(1234 + seed)  # the global RNG must not matter: only info.generator shuffles
    out = algorithm.update(agent.net, agent.net, [as_segment(worker.segment_format, packed)], info)
    return out, steps, algorithm, agent


def test_an_update_returns_its_losses_and_takes_a_fixed_number_of_steps() -> None:
    settings = VTraceSettings(num_envs=8, num_steps=16, update_epochs=2, num_minibatches=4)
    out, steps, algorithm, agent = _one_update(0, settings)
    assert list(out) == list(VTrace.losses)
    assert all(np.isfinite(v) for v in out.values())
    assert steps == 2 * 4  # every DDP rank steps alike: update_epochs x num_minibatches
    # On-policy data: the first step sees ratio 1 exactly, so the mean weight is near 1.
    assert 0.5 < out["rho_mean"] < 2.0
    # Reproducible from the seeds alone (the global RNG was reseeded differently in between).
    _, _, _, again = _one_update(0, settings)
    for a, b in zip(agent.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    obs = torch.zeros(3, 4)
    action, records = algorithm.act(agent.net, obs, torch.Generator().manual_seed(0))
    assert action.shape == (3,) and set(records) == set(VTrace.records)
    assert algorithm.value(agent.net, obs) is not None
    no_bootstrap = VTrace(VTraceSettings(bootstrap_truncated=False), algorithm.spaces)
    assert no_bootstrap.value(agent.net, obs) is None




class _FewerElsewhere(Peers):
    """Another trainer, handed ``fewest`` segments this update."""

    def __init__(self, fewest: int) -> None:
        self.elsewhere = fewest

    def fewest(self, count: int) -> int:
        return min(count, self.elsewhere)


def test_a_trainer_handed_more_segments_takes_more_steps_of_the_same_size() -> None:
    """``num_minibatches`` is per segment: a trainer fed by three collectors (layout=1t3r) takes
    three times the steps of one fed by one, each on as many env columns, so it learns as much
    per env step; with another trainer handed fewer segments, every trainer takes that one's."""
    settings = VTraceSettings(num_envs=8, num_steps=16, num_minibatches=4)
    algorithm, agent, worker = vtrace_parts(0, settings)
    segments: list[Segment] = []
    for version in range(3):
        packed, _ = worker.collect(agent, version)
        segments.append(as_segment(worker.segment_format, packed.clone()))
    worker.close()
    optimizer = algorithm.optimizer(agent.net)
    sizes: list[int] = []
    optimizer.register_step_post_hook(lambda *_: sizes.append(seen[-1]))
    seen: list[int] = []
    agent.net.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))

    def steps(handed: list[Segment], peers: Peers) -> list[int]:
        sizes.clear()
        info = UpdateInfo(optimizer, torch.Generator().manual_seed(0), 0, 0, 1, peers)
        algorithm.update(agent.net, agent.net, handed, info)
        return list(sizes)

    column = settings.num_envs // settings.num_minibatches * settings.num_steps  # 2 columns
    assert steps(segments[:1], Peers()) == [column] * 4
    assert steps(segments, Peers()) == [column] * 12
    # Another trainer was handed two: both take 8 steps; this one's hold 3 columns each.
    assert steps(segments, _FewerElsewhere(2)) == [3 * settings.num_steps] * 8
