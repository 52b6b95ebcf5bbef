"""SAC on two DDP trainers (real gloo ranks): the entropy coefficient learns from both
trainers' batches. log alpha's gradient is averaged over them (through the peers the runtime
hands the update, ``UpdateInfo.peers``: here the two ranks' world), so both trainers hold the same
alpha and the same Adam state, and that state is the one the mean of their local gradients
gives (docs/off-policy.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from gymnasium import spaces as gym_spaces
from torch.nn.parallel import DistributedDataParallel

from app.loops.sac import SAC, SACSettings
from app.runtime import Spaces, UpdateInfo
from app.runtime.core.algorithm import Peers
from app.runtime.replay.buffer import Batch
from rlcomm.testing import run_ranks

pytestmark = pytest.mark.integration

STEPS = 4
BETA1 = 0.9  # Adam's default first-moment rate, which SAC's alpha optimizer uses


def _batch(seed: int, n: int = 32) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(obs=torch.randn(n, 3, generator=g), actions=torch.rand(n, 1, generator=g) * 4 - 2,
                 rewards=torch.randn(n, generator=g), next_obs=torch.randn(n, 3, generator=g),
                 discounts=torch.full((n,), 0.99), weights=torch.ones(n),
                 indices=torch.arange(n), extras={})


class WorldPeers(Peers):
    """The trainers as the runtime's peers are, over the default group."""

    def size(self) -> int:
        return dist.get_world_size()

    def fewest(self, count: int) -> int:
        fewest = torch.tensor([count])
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        return int(fewest)

    def average(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)
        tensor.div_(self.size())


def _trainer(rank: int, world_size: int) -> dict[str, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)  # the same initial weights on both trainers, as the runtime does
        spaces = Spaces(gym_spaces.Box(-1, 1, (3,)), gym_spaces.Box(-2, 2, (1,)))
        sac = SAC(SACSettings(hidden_sizes=[16], policy_frequency=1), spaces)
        net = sac.build()
        model = DistributedDataParallel(net)
        info = UpdateInfo(sac.optimizer(net), torch.Generator().manual_seed(rank), 0, 0, 0,
                          WorldPeers())
        local: list[float] = []  # this trainer's own gradient, before the average
        sac.log_alpha.register_hook(lambda grad: local.append(float(grad)))
        moments = []
        for step in range(STEPS):
            sac.learn(model, net, _batch(seed=100 * rank + step), info)
            sac.learner_steps += 1
            moments.append(float(sac.alpha_optimizer.state[sac.log_alpha]["exp_avg"]))
        result = {"local": local, "moments": moments, "log_alpha": float(sac.log_alpha),
                  "module_log_alpha": float(net.log_alpha)}
        # DDP holds the group: it goes while both trainers are still in it. Freed on the way out
        # of this function instead, after the other trainer had left, it once hung a rank.
        del model
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def test_two_trainers_average_log_alphas_gradient_and_keep_one_alpha() -> None:
    results = run_ranks(_trainer, 2, timeout=120)
    first, second = results[0], results[1]
    assert len(first["local"]) == STEPS  # one alpha step per learner step (policy_frequency 1)
    # Different batches give different local gradients: the test can tell an average apart.
    assert all(a != pytest.approx(b, rel=1e-3) for a, b in zip(first["local"], second["local"],
                                                                 strict=True))
    assert first["log_alpha"] == second["log_alpha"] == first["module_log_alpha"]
    assert first["moments"] == second["moments"]
    expected = 0.0
    for step in range(STEPS):  # Adam's first moment of the averaged gradient
        mean = (first["local"][step] + second["local"][step]) / 2
        expected = BETA1 * expected + (1 - BETA1) * mean
        assert first["moments"][step] == pytest.approx(expected, rel=1e-5, abs=1e-9)
