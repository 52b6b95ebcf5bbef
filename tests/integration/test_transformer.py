"""The transformer policy's tensor-parallel plan (app/runtime/models/transformer.py) on two real gloo
ranks: evaluate, gradients, act, clipping and an Adam step match the unsharded model. The
policy, its plan's checks and its inputs in this process are tests/unit/test_transformer.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from app.runtime.models.transformer_tp import tensor_parallel_plan
from rlcomm.testing import run_ranks
from tests.helpers.transformer_inputs import (
    BOX,
    DISCRETE,
    make_model,
    policy_loss,
    random_actions,
    random_windows,
)

pytestmark = pytest.mark.integration
TP_TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    torch.set_num_threads(1)


def _plain(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _max_error(got: list[Tensor], want: list[Tensor]) -> float:
    return max(float((_plain(g) - w).abs().max()) for g, w in zip(got, want, strict=True))


def _tensor_parallel_rank(rank: int, world_size: int, sequence_parallel: bool,
                          replicate_rest: bool) -> list[Any]:
    """Each check on this rank; returns the actions sampled, for the ranks to compare."""
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        sampled = []
        # One block takes the plan's split-and-gather in one module; two, in two.
        for spaces, layers in ((DISCRETE, 1), (BOX, 2)):
            torch.manual_seed(3)
            ref = make_model(spaces, layers)
            torch.manual_seed(3)
            tp = make_model(spaces, layers)
            parallelize_module(tp, mesh, tensor_parallel_plan(tp, sequence_parallel,
                                                              replicate_rest=replicate_rest))
            sharded = [n for n, p in tp.named_parameters() if isinstance(p, DTensor)]
            assert "layers.0.attention.wq.weight" in sharded
            if replicate_rest:
                assert len(sharded) == len(list(tp.parameters()))
            else:
                assert "embed.weight" not in sharded
                assert ("layers.0.ffn_norm.weight" in sharded) == sequence_parallel

            obs, actions = random_windows(3, 2, seed=4), random_actions(spaces, 3, 2, seed=4)
            want, got = ref.evaluate(obs, actions), tp.evaluate(obs, actions)
            error = _max_error(list(got), list(want))
            assert error <= TP_TOLERANCE, f"evaluate differs by {error}"
            policy_loss(want).backward()
            policy_loss(got).backward()
            params = list(zip(tp.named_parameters(), ref.parameters(), strict=True))
            for (name, p), q in params:
                assert p.grad is not None and q.grad is not None
                error = _max_error([p.grad], [q.grad])
                assert error <= TP_TOLERANCE, f"{name}.grad differs by {error}"

            with torch.no_grad():
                ref_act = ref.act(obs[0], torch.Generator().manual_seed(9))
                tp_act = tp.act(obs[0], torch.Generator().manual_seed(9))
            if spaces is DISCRETE:
                assert torch.equal(ref_act[0], tp_act[0])
            error = _max_error(list(tp_act), list(ref_act))
            assert error <= TP_TOLERANCE, f"act differs by {error}"
            sampled.append(tp_act[0].tolist())

            # torch's clip_grad_norm_ refuses a DTensor/plain mix: the runtime's plan
            # (replicate_rest) makes every parameter a DTensor, and then it clips alike.
            if not replicate_rest:
                continue
            want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            got_norm = _plain(torch.nn.utils.clip_grad_norm_(tp.parameters(), 0.5))
            assert abs(float(got_norm - want_norm)) <= TP_TOLERANCE * float(want_norm)
            assert float(want_norm) > 0.5  # the clip did scale
            for (name, p), q in params:
                assert p.grad is not None and q.grad is not None
                error = _max_error([p.grad], [q.grad])
                assert error <= TP_TOLERANCE, f"{name}.grad differs by {error} after clipping"

            # One Adam step keeps sharded and replicated weights alike (the norms' gradients
            # under sequence parallelism are Partial: the step must reduce them).
            for model in (ref, tp):
                torch.optim.Adam(model.parameters(), lr=1e-3).step()
            for (name, p), q in params:
                error = _max_error([p.detach()], [q.detach()])
                assert error <= TP_TOLERANCE, f"{name} differs by {error} after a step"
        return sampled
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("sequence_parallel", "replicate_rest"),
                         [(False, False), (True, False), (False, True)],
                         ids=["tp", "tp+sp", "tp+replicated-rest"])
def test_tensor_parallel_matches_the_unsharded_model(sequence_parallel: bool,
                                                     replicate_rest: bool) -> None:
    results = run_ranks(_tensor_parallel_rank, 2, sequence_parallel, replicate_rest,
                        timeout=120)
    assert results[0] == results[1]  # equal generators: equal actions on every rank
