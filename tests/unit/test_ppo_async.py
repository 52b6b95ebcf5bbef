"""Asynchronous rollout with bounded staleness, in this process: the lockstep comparison lets
CPU rounding through but not a changed update, data older than the bound is an error, and PPO
trains a segment one version old around the weights that train it (decoupled PPO). The runs
through the app are tests/e2e/test_ppo_async.py."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from app.loops.ppo import StaleDataError, check_staleness
from app.loops.ppo.core import PPOSettings, compute_gae, ppo_batch
from app.runtime import UpdateInfo
from app.runtime.rollout.worker import as_segment
from tests.helpers.lockstep_trajectory import FIXTURE, REL_TOL, deviations
from tests.helpers.single_process import ppo_parts

pytestmark = pytest.mark.unit


def test_the_lockstep_comparison_lets_rounding_through_but_not_a_changed_update() -> None:
    recorded = json.loads(FIXTURE.read_text())

    def scaled(factor: float, update: int | None = None, key: str | None = None) -> dict[str, Any]:
        """The recording with values scaled by ``factor`` (all, or one update's ``key``)."""
        copy = json.loads(json.dumps(recorded))
        for i, row in enumerate(copy["updates"]):
            for k in row:
                if update is None or (i, k) == (update, key):
                    row[k] = (float.fromhex(row[k]) * factor).hex()
        if update is None:
            copy["param_checksum"] = {r: (float.fromhex(v) * factor).hex()
                                      for r, v in copy["param_checksum"].items()}
        return copy

    assert deviations(recorded, recorded) == []
    assert deviations(scaled(1 + 1e-4), recorded) == []  # the most another CPU strays
    off = deviations(scaled(1 + 1e-2, update=2, key="v_loss"), recorded)  # a changed update
    assert len(off) == 1 and off[0].startswith("update 3 v_loss: "), off
    assert off[0].endswith(f"recorded (1.0e-02 relative > {REL_TOL:g})"), off
    assert len(deviations(scaled(1 - 1e-2), recorded)) == 6 * 6 + 4  # every value, every rank
    shorter = {**recorded, "updates": recorded["updates"][:5]}
    assert deviations(shorter, recorded) == ["updates: 5 now, 6 recorded"]


def test_data_older_than_the_bound_is_an_error_never_trained_on() -> None:
    assert check_staleness([(2, 7), (3, 6)], current=7, max_staleness=1, update=9) == [0, 1]
    with pytest.raises(StaleDataError, match=r"update 9: rank 3's segment was collected with "
                       r"weights version 5, 2 behind version 7 \(loop.max_staleness=1\)"):
        check_staleness([(2, 7), (3, 5)], current=7, max_staleness=1, update=9)
    with pytest.raises(StaleDataError, match="-1 behind"):  # from the future: a protocol bug
        check_staleness([(2, 8)], current=7, max_staleness=3, update=9)


def test_a_segment_one_version_old_is_trained_around_the_weights_that_train_it() -> None:
    """A rollout one weights version behind (``loop.max_staleness=1``), CartPole in this process,
    a few updates: at the start of each, the clip's ratio is 1 and the value clip is centred on
    the critic being trained (so no sample's value loss starts held at the clip's bound), GAE's
    baseline is that critic, and each sample is weighted by proximal / behaviour probability.
    Centred on the values the rollout recorded, as before the fix, the clip would have held
    most samples from the first step: the critic had moved more than ``clip_coef`` since."""
    torch.set_num_threads(1)  # one thread: the same sums every run
    settings = PPOSettings(num_envs=8, num_steps=32)
    algorithm, agent, worker = ppo_parts(0, settings)
    behaviour = copy.deepcopy(agent)  # the rollout's copy of the weights
    optimizer = algorithm.optimizer(agent.net)
    generator = torch.Generator().manual_seed(0)
    held_by_recorded = []
    for update in range(6):
        packed, _ = worker.collect(behaviour, update)
        lag = 1 if update else 0  # the first segment is collected with the first weights
        segment = as_segment(worker.segment_format, packed, lag=lag)
        behaviour.load_state_dict(agent.state_dict())  # sent as the trainer starts updating
        recorded = segment["values"].reshape(-1)
        batch = ppo_batch(agent.net, [segment], settings, decoupled=lag > 0)
        with torch.no_grad():
            logprob, _, value = agent.net.evaluate(batch.obs, batch.actions)
            next_value = agent.net.value(segment["next_obs"])
        if lag == 0:  # lockstep: exactly what the rollout recorded
            assert torch.equal(batch.values, recorded) and batch.weight is None
            assert torch.equal(batch.anchor, segment["logprobs"].reshape(-1))
        else:
            torch.testing.assert_close((logprob - batch.anchor).exp(), torch.ones_like(logprob))
            torch.testing.assert_close(batch.values, value)
            assert not ((value - batch.values).abs() > settings.clip_coef).any()
            held_by_recorded.append(
                ((value - recorded).abs() > settings.clip_coef).float().mean().item())
            advantages, _ = compute_gae(segment, next_value, settings.gamma,
                                        settings.gae_lambda, value.reshape(segment["values"].shape))
            torch.testing.assert_close(batch.advantages, advantages.reshape(-1))
            assert batch.weight is not None
            torch.testing.assert_close(
                batch.weight, (batch.anchor - segment["logprobs"].reshape(-1)).exp())
            assert (batch.weight != 1).any()  # the behaviour policy really was another one
        env_steps = (update + 1) * settings.num_envs * settings.num_steps
        algorithm.update(agent.net, agent.net, [segment],
                         UpdateInfo(optimizer, generator, env_steps, update, lag))
    worker.close()
    assert min(held_by_recorded) > 0.3, held_by_recorded
