"""``loop.trackers`` before launch (docs/running.md): ``loop.tensorboard=true`` is the same as
naming tensorboard, names are checked, and what the trackers get of a row and a summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import ConfigError
from app.loops.ppo import PPOLoop
from app.output.trackers import TRACKERS, check_trackers
from app.output.trackers.base import finite, flat, summary_figures
from app.output.trackers.fanout import read_side_file
from app.runtime.settings.builders import tracking as trackers_of

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("settings", "names"), [
    ({}, None),
    ({"tensorboard": True}, ("tensorboard",)),
    ({"trackers": ["tensorboard"]}, ("tensorboard",)),
    ({"trackers": ["wandb", "tensorboard"], "tensorboard": True}, ("wandb", "tensorboard")),
    ({"trackers": ["mlflow", "mlflow", "wandb"]}, ("mlflow", "wandb")),
], ids=["none", "loop.tensorboard", "named", "both ways", "twice"])
def test_loop_tensorboard_is_the_same_tracker_as_naming_it(
    settings: dict[str, object], names: tuple[str, ...] | None,
) -> None:
    loop = PPOLoop(**settings)
    tracking = trackers_of(loop, resumed_from=None)
    assert (tracking.names if tracking is not None else None) == names
    if tracking is not None:  # without a Hydra config in the run dir: the loop's own settings
        assert tracking.params is not None and tracking.params["loop"]["window"] == loop.window


def test_each_name_is_a_tracker_with_an_extra_and_a_bad_one_is_one_line() -> None:
    assert list(TRACKERS) == ["tensorboard", "wandb", "mlflow"]
    for tracker in TRACKERS.values():
        assert tracker.extra == tracker.name
    with pytest.raises(ConfigError) as failure:
        check_trackers(["tensorboard", "comet"])
    assert str(failure.value) == (
        "loop.trackers: unknown tracker 'comet'; one of tensorboard, wandb, mlflow")


def test_trackers_get_finite_numbers_and_the_summarys_figures() -> None:
    assert finite({"a": 1, "b": float("nan"), "c": float("inf"), "d": 2.5, "e": "text"}) == {
        "a": 1.0, "d": 2.5}
    summary = {"loop": "app.loops.ppo.PPOLoop", "solved": True, "env_steps": 4096,
               "time_to_target_s": None, "eval": {"return_mean": 480.5, "version": 7},
               "files": {"metrics.csv": "/run/metrics.csv"}}
    assert summary_figures(summary) == {"summary/solved": 1.0, "summary/env_steps": 4096.0,
                                        "summary/eval.return_mean": 480.5,
                                        "summary/eval.version": 7.0}
    assert flat({"loop": {"hparams": {"lr": 3e-4}, "env": {"kwargs": {}}}, "seed": 0}) == {
        "loop.hparams.lr": 3e-4, "loop.env.kwargs": {}, "seed": 0}


def test_a_resume_reads_the_trackers_of_the_checkpoints_run_dir(tmp_path: Path) -> None:
    (tmp_path / "trackers.json").write_text('{"wandb": {"id": "abc", "last_step": 4096}}')
    for checkpoint in ("ckpt_000002.pt", "ckpt_000002"):  # flat, sharded
        assert read_side_file(tmp_path / "checkpoints" / checkpoint) == {
            "wandb": {"id": "abc", "last_step": 4096}}
    assert read_side_file(tmp_path / "elsewhere" / "checkpoints" / "ckpt_000001.pt") == {}
