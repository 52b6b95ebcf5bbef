"""PPO's policy receiver (app/loops/ppo) on two real gloo ranks: weights of another layout are
rejected, naming the tensor, and the sender fails too. PPO runs through the app are
tests/e2e/test_ppo.py."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def _send_a_changed_policy(rank: int, world_size: int) -> str:
    from app.loops.ppo import policy_receiver
    from app.runtime.envs.vector import EnvConfig, probe_spaces
    from app.runtime.models.actor_critic import ActorCritic
    from rlcomm import CommContext, ParallelMode
    from rlcomm.weights import WeightSender, WeightTransferError

    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)
    ctx.init_group([[0, 1]], ParallelMode.WEIGHT_TRANSFER, backend="gloo")
    policy = ActorCritic.from_spaces(probe_spaces(EnvConfig()), 64)
    try:
        if rank == 0:
            state = dict(policy.state_dict())
            state["actor.0.weight"] = state["actor.0.weight"].double()  # the trainer's dtype changed
            WeightSender(ctx, ParallelMode.WEIGHT_TRANSFER).send(state)
        else:
            policy_receiver(ctx, policy).receive_into(policy)
        return "no error"
    except WeightTransferError as err:
        return str(err)
    finally:
        ctx.destroy()


def test_the_ppo_receiver_rejects_weights_of_another_layout_naming_the_tensor() -> None:
    from rlcomm.testing import run_ranks

    said = run_ranks(_send_a_changed_policy, 2)
    assert "tensor 'actor.0.weight' is [64, 4] float64 but expected [64, 4] float32" in said[1]
    assert said[0] != "no error"  # the sender fails too, nobody is left waiting
