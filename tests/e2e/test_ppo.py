"""The distributed PPO loop through the app, on real processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.apprun import metrics, run_ppo

SMALL = ("loop.hparams.num_envs=4", "loop.hparams.num_steps=64")


def trainer_result(result: dict) -> dict:
    return next(r["result"] for r in result["ranks"] if r["role"].startswith("trainer"))


@pytest.mark.e2e
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


@pytest.mark.e2e
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
    else:  # nothing is sent: no weight-transfer time (the figure sweeps and the summary read)
        assert result["metrics"]["transfer_share"] == 0.0
        assert "transfer_fraction" not in result["ranks"][0]["result"]


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_resumed_attempts_env_steps_per_s_counts_only_its_own_steps(tmp_path: Path) -> None:
    base = ("layout=single", *SMALL, "loop.target_return=1e9", "loop.checkpoint_every=2")
    run_ppo(tmp_path / "first", *base, "loop.total_env_steps=1024")  # 4 updates of 256 steps
    resumed = run_ppo(tmp_path / "more", *base, "loop.total_env_steps=2048",
                      f"loop.resume={tmp_path / 'first'}")
    rows = metrics(tmp_path / "more")
    assert [r["update"] for r in rows] == [5.0, 6.0, 7.0, 8.0]
    per_update = rows[1]["env_steps"] - rows[0]["env_steps"]
    resumed_at = rows[0]["env_steps"] - per_update  # the checkpoint's env steps
    assert resumed_at == 1024
    for row in rows:  # wall_s is this attempt's time: the rate is over this attempt's steps
        assert row["env_steps_per_s"] == pytest.approx(
            (row["env_steps"] - resumed_at) / row["wall_s"], rel=1e-9
        ), row
    # The rank's result and the job's figure (and so the closing summary) say the same.
    assert trainer_result(resumed)["env_steps_per_s"] == resumed["metrics"]["env_steps_per_s"]
    assert resumed["summary"]["env_steps_per_s"] == resumed["metrics"]["env_steps_per_s"]


@pytest.mark.e2e
def test_same_seed_same_layout_is_reproducible(tmp_path: Path) -> None:
    args = ("layout=1t1r", *SMALL, "loop.total_env_steps=1024", "loop.checkpoint_every=0", "seed=3")
    a = run_ppo(tmp_path / "a", *args)
    b = run_ppo(tmp_path / "b", *args)
    assert trainer_result(a)["param_checksum"] == trainer_result(b)["param_checksum"]
    assert [r["mean_return"] for r in metrics(tmp_path / "a")] == [
        r["mean_return"] for r in metrics(tmp_path / "b")
    ]


