"""Each shipped loop plans its own default layout unless the command line names one, Hydra says
whose choice the layout was (the start line and ``--help``), and ``loop.replay.min_size`` counts
the whole run's transitions, shared among the run's replay shards (docs/off-policy.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hydra import compose, initialize_config_dir

from app.config.provenance import Choice, choice_for
from app.errors import ConfigError
from app.launch.planning import validate
from app.runtime.replay.buffer import ReplaySettings
from tests.helpers.apprun import REPO

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _hydra() -> Iterator[None]:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        yield


@pytest.mark.parametrize(("overrides", "world_size", "trainers", "who"), [
    (["loop=dqn"], 1, [0], "loop=dqn"),
    (["loop=sac"], 1, [0], "loop=sac"),
    # Each MuJoCo experiment names the layout measured fastest for it (docs/mujoco.md).
    (["+experiment=hopper_sac"], 1, [0], "+experiment=hopper_sac"),
    (["+experiment=halfcheetah_sac"], 1, [0], "+experiment=halfcheetah_sac"),
    (["+experiment=hopper"], 3, [0], "+experiment=hopper"),
    (["+experiment=halfcheetah"], 3, [0], "+experiment=halfcheetah"),
    (["+experiment=walker2d"], 3, [0], "+experiment=walker2d"),
    (["+experiment=hopper", "layout=single"], 1, [0], "command line"),
    (["+experiment=hopper_sac", "layout=2t2r"], 4, [0, 1], "command line"),
    (["loop=dqn", "layout=2t2r"], 4, [0, 1], "command line"),
    (["loop=sac", "layout=2t2r"], 4, [0, 1], "command line"),
    (["loop=sac", "layout=1t1r"], 2, [0], "command line"),
    ([], 4, [0, 1], "app"),  # PPO trains fastest on the app's default, 2t2r
    (["loop=vtrace"], 4, [0, 1], "app"),
], ids=["dqn", "sac", "hopper_sac", "halfcheetah_sac", "hopper", "halfcheetah", "walker2d",
        "hopper single", "hopper_sac 2t2r", "dqn 2t2r", "sac 2t2r", "sac 1t1r", "ppo", "vtrace"])
def test_a_loop_plans_its_own_layout_unless_the_command_line_names_one(
        overrides: list[str], world_size: int, trainers: list[int], who: str) -> None:
    plan = validate(compose("config", overrides=overrides))
    assert (plan.world_size, list(plan.trainers)) == (world_size, trainers)
    choice = choice_for("layout", overrides)
    assert choice is not None and choice.chosen_by == who, choice


@pytest.mark.parametrize(("experiment", "compile_mode"), [
    ("hopper", "inductor"), ("halfcheetah", "inductor"), ("walker2d", "inductor"),
    ("hopper_sac", "off"), ("halfcheetah_sac", "off"),
])
def test_a_mujoco_experiment_names_its_compile_setting_and_the_command_line_wins(
        experiment: str, compile_mode: str) -> None:
    assert compose("config", overrides=[f"+experiment={experiment}"]).loop.compile == compile_mode
    other = "off" if compile_mode == "inductor" else "inductor"
    mine = compose("config", overrides=[f"+experiment={experiment}", f"loop.compile={other}"])
    assert mine.loop.compile == other


def test_the_start_line_names_the_layout_and_whose_choice_it_was() -> None:
    assert Choice("layout", "single", "loop=dqn").line() == (
        "layout: single (loop=dqn's default; layout=... to choose another)")
    assert Choice("layout", "2t2r", "command line").line() == (
        "layout: 2t2r (layout=2t2r on the command line)")
    assert Choice("layout", "2t2r", "app").line() == (
        "layout: 2t2r (the app's default; layout=... to choose another)")
    assert Choice("layout", "1t2r", "+experiment=hopper").line() == (
        "layout: 1t2r (+experiment=hopper's default; layout=... to choose another)")


def test_help_lists_each_loops_layout() -> None:
    from app.config.help import help_text

    cfg = compose("config", overrides=[], return_hydra_config=True)
    text = help_text(_root_=cfg)
    line = next(x for x in text.splitlines() if "each loop's layout" in x)
    assert "dqn single, sac single" in line and "the others 2t2r (the app's default)" in line, line


@pytest.mark.parametrize(("min_size", "shards", "share"), [
    (5000, 1, 5000), (5000, 2, 2500), (5001, 2, 2501), (0, 3, 0), (10, 3, 4),
])
def test_min_size_is_the_whole_runs_and_each_shard_waits_for_its_share(
        min_size: int, shards: int, share: int) -> None:
    settings = ReplaySettings(capacity=10_000, min_size=min_size)
    assert settings.shard_min_size(shards) == share
    assert share * shards >= min_size > (share - 1) * shards  # rounded up, by less than a shard


def test_min_size_may_exceed_one_shards_capacity_when_the_shards_hold_it_together() -> None:
    settings = ReplaySettings(capacity=3000, batch_size=64, min_size=5000, tolerance=64.0)
    assert settings.range_errors(segment_steps=8, shards=2) == []
    assert settings.range_errors(segment_steps=8, shards=1) == [
        "replay.min_size: must be at most capacity (3000), got 5000"]
    assert ReplaySettings(capacity=2000, batch_size=64, min_size=5000,
                          tolerance=64.0).range_errors(segment_steps=8, shards=2) == [
        "replay.min_size: must be at most 2 shards x capacity (4000), got 5000"]


def test_a_min_size_the_trainers_shards_cannot_hold_is_one_line_before_launch() -> None:
    with pytest.raises(ConfigError) as failure:
        validate(compose("config", overrides=[
            "loop=dqn", "layout=2t2r", "loop.replay.capacity=1000", "loop.replay.min_size=3000"]))
    assert str(failure.value) == (
        "loop.replay.min_size: must be at most 2 shards x capacity (2000), got 3000")
