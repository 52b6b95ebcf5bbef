"""Weights are data, not code: real PPO ranks (app/launch/rank.py, forked from here)
send weights and gather trajectories with every way torch.distributed or the stdlib could
unpickle made to raise. Bad input through ``python -m app`` (resume paths, ranks that die or
never join) is tests/e2e/test_reliability.py."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlcomm.testing import run_ranks
from tests.helpers.apprun import REPO

pytestmark = pytest.mark.integration
# Small PPO steps so an update takes a fraction of a second even on 2 loaded cores.
PPO_SMALL = ("loop.hparams={num_envs:4,num_steps:64}", "loop.progress=false", "loop.target_return=1e9")
STEPS_PER_UPDATE = 2 * 4 * 64  # layout 2t2r: 2 rollout ranks x num_envs x num_steps


def _forbid_unpickling(calls: list[str]) -> None:
    """Make every way torch.distributed or the stdlib could unpickle raise (this process only)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def trap(name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called: something was unpickled")

        return refuse

    class RefusingUnpickler(pickle.Unpickler):  # a class still, so subclasses can be defined
        def load(self) -> Any:
            return trap("pickle.Unpickler.load")()

    pickle.Unpickler = RefusingUnpickler  # type: ignore[misc]
    c10d._unpickler = RefusingUnpickler  # torch's object collectives unpickle through this
    for module, name in [(pickle, "loads"), (pickle, "load"), (c10d, "_tensor_to_object")]:
        setattr(module, name, trap(f"{module.__name__}.{name}"))
    for name in ("broadcast_object_list", "all_gather_object", "gather_object",
                 "scatter_object_list", "recv_object_list", "send_object_list"):
        for module in (dist, c10d):
            if hasattr(module, name):
                setattr(module, name, trap(f"{module.__name__}.{name}"))


def _ppo_rank_without_unpickling(rank: int, world_size: int, config: dict[str, Any],
                                 run_dir: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from app.launch.planning import validate_job
    from app.launch.rank import run_rank
    from rlcomm import CommContext, collectives

    calls: list[str] = []
    _forbid_unpickling(calls)
    plan, job = validate_job(OmegaConf.create(config))  # as the launcher does
    result = run_rank(job, plan, run_dir)  # the real rank: weight transfer, trajectory gather, ...
    assert not calls, calls  # nothing swallowed a trap
    # The trap is live in this process: the one pickle-based helper rlcomm has trips it.
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)
    try:
        with pytest.raises(AssertionError, match="unpickled"):
            collectives.broadcast_object_list(ctx, "GLOBAL", [None])
    finally:
        ctx.destroy()
    return {"result": result, "trapped": calls}


def test_weights_and_trajectories_travel_without_unpickling(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    updates = 3
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            *PPO_SMALL, f"loop.total_env_steps={updates * STEPS_PER_UPDATE}",
            "loop.checkpoint_every=0", "comm.timeout=60",
        ])
    config = OmegaConf.to_container(cfg, resolve=True)
    out = run_ranks(_ppo_rank_without_unpickling, 4, config, str(tmp_path), timeout=180)
    assert all(o["trapped"] == ["torch.distributed.broadcast_object_list"] for o in out.values())
    summary = out[0]["result"]
    assert summary["status"] == "ok"
    by_rank = {r["rank"]: r["result"] for r in summary["ranks"]}
    # Rollout ranks received every version of the weights and their trajectories were used.
    assert [by_rank[r]["weights_version"] for r in range(4)] == [updates] * 4
    assert [by_rank[r]["env_steps"] for r in range(4)] == [updates * STEPS_PER_UPDATE] * 4
