"""The image policy under DDP, wrapped as the runtime wraps a trainer's, keeps every gradient in
its parameter's layout: no "Grad strides do not match bucket view strides" warning.

The cause this guards against: on a 1-channel image (``+experiment=image``'s 36x36x1 env), the
Nature CNN's input is a permuted HWC view with channels_last strides, so oneDNN returns the first
convolution's weight gradient [32, 1, 8, 8] in channels_last strides (64, 1, 8, 1). Autograd keeps
it (only the size-1 dimension's stride differs), but the parameter, a view of the weights' send
buffer since ``WeightSender.bind`` (contiguous (64, 64, 8, 1)), is what DDP's bucket views copy,
and the reducer compares strides exactly. app/runtime/models/actor_critic.py restrides such gradients.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from app.runtime.core.algorithm import Spaces
from app.runtime.models.actor_critic import ActorCritic
from rlcomm import CommContext, ParallelMode
from rlcomm.testing import run_ranks
from rlcomm.weights import WeightReceiver, WeightSender
from tests.helpers.image_env import ImageSideEnv
from tests.helpers.weights import TIMEOUT_S, mismatches, restore, snapshot, weight_groups

pytestmark = pytest.mark.integration

WT = ParallelMode.WEIGHT_TRANSFER
TDP = ParallelMode.TRAIN_DATA_PARALLEL
WARNING = "Grad strides do not match bucket view strides"


def wrap_trainer(ctx: CommContext, net: nn.Module) -> tuple[WeightSender, nn.Module]:
    """A trainer of a layout with rollout ranks, as app/runtime/exchange.py and run.py build it: the policy bound
    to the weights' send buffer first (its parameters become views there), then DDP over the
    trainers' data-parallel group."""
    sender = WeightSender(ctx, WT, verify_every=0)
    sender.bind(net)
    return sender, DistributedDataParallel(net, process_group=ctx.get_group(TDP))


def _image_spaces() -> Spaces:
    env = ImageSideEnv()  # +experiment=image's env: 36x36x1 uint8, Discrete(2)
    return Spaces(env.observation_space, env.action_space)


def _trainer_and_rollout(rank: int, world_size: int) -> Any:
    # 2t2r: trainers 0, 1 under DDP, each sending its weights to a rollout rank (0 -> 2, 1 -> 3).
    with weight_groups([[0, 2], [1, 3]]) as ctx:
        spaces = _image_spaces()
        torch.manual_seed(0)  # every rank builds the same initial weights, as the runtime does
        net = ActorCritic(spaces)
        if rank >= 2:
            receiver = WeightReceiver(ctx, WT, expected=net.state_dict())
            receiver.bind(net)
            return [(receiver.receive_into(net), snapshot(net.state_dict())) for _ in range(2)]
        ctx.init_group([0, 1], TDP, backend="gloo")
        sender, model = wrap_trainer(ctx, net)
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
        sent = [sender.send(net)]  # the first version carries the layout
        gen = torch.Generator().manual_seed(rank)  # different data on each trainer
        obs = torch.randint(0, 256, (64, *spaces.observation.shape), dtype=torch.uint8,
                            generator=gen)
        actions = torch.randint(0, int(spaces.action.n), (64,), generator=gen)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the reducer warns once per process
            optimizer.zero_grad()
            logprob, entropy, value = model(obs, actions)
            (value.square().mean() - logprob.mean() - 0.01 * entropy.mean()).backward()
        layouts = {name: (p.stride(), p.grad.stride()) for name, p in net.named_parameters()
                   if p.grad is not None and p.grad.stride() != p.stride()}
        optimizer.step()
        sent.append(sender.send(net))
        return {
            "warnings": [str(w.message) for w in caught if WARNING in str(w.message)],
            "layouts": layouts,  # name: (parameter strides, gradient strides), where they differ
            "copied": sender._copied,  # tensors the send had to copy: 0 while all stay bound
            "sent": sent,
            "state": snapshot(net.state_dict()),
        }


def test_image_policy_gradients_match_ddp_bucket_views() -> None:
    results = run_ranks(_trainer_and_rollout, 4, timeout=TIMEOUT_S)
    for trainer, rollout in ((0, 2), (1, 3)):
        got = results[trainer]
        assert got["warnings"] == [], f"trainer {trainer}: {got['warnings'][0]}"
        assert got["layouts"] == {}, f"trainer {trainer}: gradients not in their parameter's strides"
        # Still bound after DDP, a backward and an optimizer step: the send copied nothing.
        assert got["copied"] == 0
        received = results[rollout]
        assert [version for version, _ in received] == got["sent"] == [1, 2]
        assert mismatches(restore(received[-1][1]), restore(got["state"])) == []
    # DDP averaged the gradients: both trainers stepped to the same weights.
    assert mismatches(restore(results[0]["state"]), restore(results[1]["state"])) == []
