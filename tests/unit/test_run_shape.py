"""The run's shape (app.api.RunShape), derived once by the launcher (app/launch/shape.py): what
each layout and loop get, the combinations refused in one line, the plan the ranks get planned
with its flags, the shape carried to the ranks as it is, and no other module of the app
deriving what it holds (docs/layouts.md, "The run's shape")."""

from __future__ import annotations

import ast
import dataclasses
import pickle

import pytest
from hydra import compose, initialize_config_dir

from app.api import ConfigError, JobInfo, RunShape
from app.launch.planning import ValidatedJob, layout_spec, validate_job
from rlcomm import LayoutPlan, plan_layout
from tests.helpers.apprun import REPO

pytestmark = pytest.mark.unit

APP = REPO / "app"
# Issue 60's repro: two trainers, a replay rank, two elastic rollout ranks.
REPLAY_TWO_TRAINERS = ["loop=dqn", "layout=replay_server", "layout.world_size=5",
                       "layout.trainers=[0,1]", "layout.replay=[2]", "layout.rollouts=[3,4]",
                       "layout.elastic_rollouts=true"]


def _validated(overrides: list[str]) -> tuple[LayoutPlan, ValidatedJob]:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return validate_job(compose("config", overrides=overrides))


@pytest.mark.parametrize(("overrides", "shape"), [
    ([], RunShape(elastic_rollouts=True, elastic_trainers=True)),
    (["loop.data_parallel=fsdp"], RunShape(elastic_rollouts=True, data_parallel="fsdp",
                                           sharded=True)),
    (["loop.data_parallel=fsdp", "layout.elastic_rollouts=false"],
     RunShape(data_parallel="fsdp", sharded=True)),
    (["layout=tp2dp2", "loop.model.kind=transformer"], RunShape(sharded=True, colocated=True)),
    (["loop.data_parallel=fsdp", "layout.trainer_replicas=2"],
     RunShape(elastic_rollouts=True, elastic_trainers=True, data_parallel="fsdp", sharded=True,
              trainer_replicas=2)),
    (["layout=single"], RunShape(colocated=True)),
    (["loop=commcheck"], RunShape()),
    (["comm=nccl"], RunShape()),  # epoch groups are gloo: nothing elastic
    (["loop=dqn", "layout=replay_server"], RunShape(replay_ranks=(1,))),
    (REPLAY_TWO_TRAINERS, RunShape(elastic_rollouts=True, replay_ranks=(2,))),
], ids=["default", "fsdp", "fsdp static", "tp2dp2", "replica groups", "colocated", "commcheck",
        "nccl", "replay server", "replay server, elastic rollout ranks"])
def test_each_layout_and_loop_get_their_shape(overrides: list[str], shape: RunShape) -> None:
    _, job = _validated(overrides)
    assert job.shape == shape


@pytest.mark.parametrize(("shape", "hand_off", "forwards"), [
    (RunShape(), "flat", False),
    (RunShape(colocated=True, sharded=True, data_parallel="fsdp"), "flat", False),
    (RunShape(sharded=True, data_parallel="fsdp"), "sharded", False),
    (RunShape(elastic_rollouts=True), "elastic", False),
    (RunShape(elastic_rollouts=True, sharded=True, data_parallel="fsdp"), "elastic-sharded",
     False),
    # Replica groups hand whole weights: a lost group would take its owners' shards.
    (RunShape(elastic_rollouts=True, elastic_trainers=True, sharded=True, trainer_replicas=2),
     "elastic", False),
    (RunShape(replay_ranks=(1,)), "flat", False),
    (RunShape(elastic_rollouts=True, replay_ranks=(1,)), "elastic", True),
])
def test_what_the_shape_says_follows_from_what_it_holds(shape: RunShape, hand_off: str,
                                                        forwards: bool) -> None:
    assert (shape.hand_off, shape.forwards) == (hand_off, forwards)


@pytest.mark.parametrize(("overrides", "line"), [
    # Issue 60, item 4: replay ranks serve a fixed set of trainers.
    ([*REPLAY_TWO_TRAINERS, "layout.elastic_trainers=true"],
     "layout.elastic_trainers: true, but replay ranks (layout.replay=[2]) serve a fixed set of "
     "trainers; use layout.replay=[] (a replay per trainer) for elastic trainers"),
    ([*REPLAY_TWO_TRAINERS, "launcher.trainer_restarts=1"],
     "launcher.trainer_restarts: 1 restarts a lost trainer, but trainers are static here "
     "(replay ranks (layout.replay=[2]) serve a fixed set of trainers"),
    (["loop=dqn", "loop.data_parallel=fsdp"],
     "loop.data_parallel: fsdp on this layout shards the trainers, but DQNLoop needs DDP "
     "trainers (data_parallel=ddp, no tensor or sequence parallelism)"),
    (["loop=sac", "layout=tp2dp2"],
     "loop.data_parallel: ddp on this layout shards the trainers, but SACLoop needs DDP "
     "trainers"),
], ids=["elastic trainers beside replay ranks", "trainer restarts beside replay ranks",
        "an off-policy loop on fsdp", "an off-policy loop on a tensor-parallel grid"])
def test_a_shape_that_is_not_supported_is_one_line(overrides: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as failure:
        _validated(overrides)
    assert str(failure.value).startswith(line)
    assert "\n" not in str(failure.value)


@pytest.mark.parametrize("overrides", [[], ["loop=commcheck"], ["layout=single"],
                                       ["comm=nccl"], REPLAY_TWO_TRAINERS])
def test_the_ranks_plan_is_planned_with_the_shapes_flags(overrides: list[str]) -> None:
    """rlcomm gets the flags as the plan's input (which ranks may be lost and replaced:
    ``LayoutPlan.is_elastic_rank``), not rewritten into a plan after the fact."""
    import app.__main__  # noqa: F401

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    plan, job = validate_job(cfg)
    shape = job.shape
    assert plan == plan_layout(dataclasses.replace(
        layout_spec(cfg), elastic_rollouts=shape.elastic_rollouts,
        elastic_trainers=shape.elastic_trainers))
    assert bool(plan.elastic_modes) == shape.elastic_rollouts
    assert [plan.is_elastic_rank(r) for r in plan.rollouts] == \
        [shape.elastic_rollouts] * len(plan.rollouts)
    assert any(plan.is_elastic_rank(t) for t in plan.trainers) == shape.elastic_trainers


def test_the_shape_travels_to_the_ranks_as_it_is() -> None:
    _, job = _validated([])
    sent = pickle.loads(pickle.dumps(job))  # as the local launcher hands it to every rank
    assert isinstance(sent, ValidatedJob) and sent.shape == job.shape
    # A loop cannot be handed a job without its shape: JobInfo has no default for it.
    shape_field = next(f for f in dataclasses.fields(JobInfo) if f.name == "shape")
    assert shape_field.default is dataclasses.MISSING
    assert shape_field.default_factory is dataclasses.MISSING


# What the shape holds, read off anything else: the app derives it once (app/launch/shape.py).
SHAPE_FLAGS = ("elastic_rollouts", "elastic_trainers", "trainer_replicas")
DERIVERS = {"app/launch/shape.py", "app/api.py"}
# Where the plan is planned with the shape's flags (its spec's elastic_* arguments).
PLANNERS = {"app/launch/shape.py", "app/launch/planning.py"}


def _is_shape(node: ast.expr) -> bool:
    """``shape``, ``job.shape``, ``self.shape``, ``trained.shape``..."""
    return (isinstance(node, ast.Name) and node.id == "shape") or (
        isinstance(node, ast.Attribute) and node.attr == "shape")


def _derivations(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, where)):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if (isinstance(node, ast.Attribute) and node.attr in SHAPE_FLAGS
                and isinstance(node.ctx, ast.Load) and not _is_shape(node.value)):
            found.append(f"{line} reads .{node.attr} of something not the run's shape")
        if isinstance(node, ast.Name | ast.Attribute) and "is_sharded" in (
                getattr(node, "id", None), getattr(node, "attr", None)):
            found.append(f"{line} derives whether the trainers are sharded")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            reads = [s for s in sides if isinstance(s, ast.Attribute)
                     and s.attr == "data_parallel" and not _is_shape(s.value)]
            if reads and any(isinstance(s, ast.Constant) and isinstance(s.value, str)
                             for s in sides):
                found.append(f"{line} compares a loop's data_parallel (sharded?)")
        if (isinstance(node, ast.Call) and where not in PLANNERS
                and any(k.arg in SHAPE_FLAGS for k in node.keywords)):
            found.append(f"{line} sets a plan's or shape's flags")
    return found


def test_nothing_in_the_app_derives_what_the_shape_holds() -> None:
    found = []
    for path in sorted(APP.rglob("*.py")):
        where = str(path.relative_to(REPO))
        if where not in DERIVERS:
            found += _derivations(path.read_text(), where)
    assert found == []


def test_the_check_of_derivations_finds_them() -> None:
    """The check above can fail: the derivations the app had before the shape are found."""
    found = _derivations(
        "elastic = not plan.colocated and plan.elastic_rollouts\n"
        "sharded = is_sharded(plan, loop.data_parallel)\n"
        "other = loop.data_parallel != 'ddp'\n"
        "plan = dataclasses.replace(plan, elastic_trainers=True)\n"
        "fine = job.shape.elastic_trainers and shape.trainer_replicas > 1\n"
        "also = self.shape.data_parallel == 'fsdp'\n", "app/runtime/sample.py")
    assert sorted(f.split(":")[1].split()[0] for f in found) == ["1", "2", "3", "4"], found
