"""The distributed PPO loop through the app, on real processes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.apprun import describe, run_app

SMALL = ("loop.hparams.num_envs=4", "loop.hparams.num_steps=64")


def run_ppo(run_dir: Path, *overrides: str) -> dict:
    proc = run_app("loop.progress=false", f"hydra.run.dir={run_dir}", *overrides)
    assert proc.returncode == 0, describe(proc)
    return json.loads((run_dir / "result.json").read_text())


def trainer_result(result: dict) -> dict:
    return next(r["result"] for r in result["ranks"] if r["role"].startswith("trainer"))


def metrics(run_dir: Path) -> list[dict[str, float]]:
    with (run_dir / "metrics.csv").open() as handle:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def test_return_clearly_improves_and_outputs_are_valid(tmp_path: Path) -> None:
    result = run_ppo(tmp_path, "layout=1t1r", "loop.total_env_steps=40960", "loop.target_return=1e9")
    rows = metrics(tmp_path)
    assert len(rows) == 40 and rows[-1]["env_steps"] == 40960
    returns = [r["mean_return"] for r in rows if r["mean_return"] == r["mean_return"]]
    first, last = returns[0], sum(returns[-5:]) / 5
    assert last > 2 * first and last > 100, (first, last)
    assert {"pg_loss", "v_loss", "entropy", "weights_version", "transfer_s_total"} <= set(rows[0])
    assert rows[-1]["weights_version"] == 40  # one transfer per update
    png = (tmp_path / "learning_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert trainer_result(result)["updates"] == 40


@pytest.mark.parametrize("layout", ["single", "2t2r"])
def test_colocated_and_split_layouts_run(layout: str, tmp_path: Path) -> None:
    result = run_ppo(tmp_path, f"layout={layout}", *SMALL, "loop.total_env_steps=2048",
                     "loop.checkpoint_every=0")
    world = 1 if layout == "single" else 4
    assert len(result["ranks"]) == world
    steps = {r["result"]["env_steps"] for r in result["ranks"]}
    assert steps == {2048}  # every rank agrees on the global count
    if layout == "2t2r":
        versions = {r["rank"]: r["result"]["weights_version"] for r in result["ranks"]}
        assert versions == {0: 4, 1: 4, 2: 4, 3: 4}  # 2 collectors x 256 steps: 4 updates
    else:
        assert result["ranks"][0]["result"]["transfer_fraction"] == 0.0


def test_checkpoint_then_resume_continues_and_matches_parameters(tmp_path: Path) -> None:
    first = tmp_path / "first"
    base = ("layout=1t1r", *SMALL, "loop.target_return=1e9", "loop.checkpoint_every=4")
    done = trainer_result(run_ppo(first, *base, "loop.total_env_steps=2048"))  # 8 updates
    assert done["updates"] == 8
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == [
        "ckpt_000004.pt", "ckpt_000008.pt"
    ]
    # Resuming at the budget does no more work: parameters are exactly the checkpoint's.
    same = trainer_result(run_ppo(tmp_path / "same", *base, "loop.total_env_steps=2048",
                                  f"loop.resume={first}"))
    assert same["updates"] == 8 and same["param_checksum"] == done["param_checksum"]
    # Resuming with a larger budget continues the counters from update 8.
    more_dir = tmp_path / "more"
    more = trainer_result(run_ppo(more_dir, *base, "loop.total_env_steps=3072",
                                  f"loop.resume={first / 'checkpoints' / 'ckpt_000008.pt'}"))
    assert more["updates"] == 12 and more["env_steps"] == 3072
    assert [r["update"] for r in metrics(more_dir)] == [9.0, 10.0, 11.0, 12.0]


def test_same_seed_same_layout_is_reproducible(tmp_path: Path) -> None:
    args = ("layout=1t1r", *SMALL, "loop.total_env_steps=1024", "loop.checkpoint_every=0", "seed=3")
    a = run_ppo(tmp_path / "a", *args)
    b = run_ppo(tmp_path / "b", *args)
    assert trainer_result(a)["param_checksum"] == trainer_result(b)["param_checksum"]
    assert [r["mean_return"] for r in metrics(tmp_path / "a")] == [
        r["mean_return"] for r in metrics(tmp_path / "b")
    ]


def _send_a_changed_policy(rank: int, world_size: int) -> str:
    from app.loops.ppo import policy_receiver
    from app.loops.ppo.core import ActorCritic
    from rlcomm import CommContext, ParallelMode
    from rlcomm.weight_transfer import WeightSender, WeightTransferError

    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=60)
    ctx.init_group([[0, 1]], ParallelMode.WEIGHT_TRANSFER, backend="gloo")
    policy = ActorCritic(4, 2, 64)
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
    from tests.multiproc import run_ranks

    said = run_ranks(_send_a_changed_policy, 2)
    assert "tensor 'actor.0.weight' is [64, 4] float64 but expected [64, 4] float32" in said[1]
    assert said[0] != "no error"  # the sender fails too, nobody is left waiting
