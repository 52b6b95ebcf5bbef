"""The replay on its own ranks, without processes: ``layout.replay`` in the planner (a third
role, its group, every error one line), the routing of collectors to replay ranks, the batch
shares, a sampled batch's wire format, and the checks before launch
(app/runtime/replay/service.py, routing.py, messages.py, docs/off-policy.md)."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from app.errors import ConfigError
from app.launch.planning import validate
from app.runtime.core.algorithm import Record, Segment
from app.runtime.core.segments import Field, SegmentFormat
from app.runtime.replay.buffer import Replay, ReplaySettings
from app.runtime.replay.messages import batch_format
from app.runtime.replay.routing import batch_shares, collectors, replay_rank_of, writers_of
from rlcomm import LayoutError, LayoutSpec, ParallelMode, format_plan, plan_layout
from tests.helpers.apprun import REPO

pytestmark = pytest.mark.unit


def test_replay_ranks_are_a_third_role_with_their_own_group() -> None:
    plan = plan_layout(LayoutSpec(world_size=5, trainers=[0], replay=[1, 2]))
    assert (plan.trainers, plan.replay, plan.rollouts) == ((0,), (1, 2), (3, 4))  # the rest
    assert [plan.role(r) for r in range(5)] == ["trainer", "replay", "replay", "rollout",
                                                "rollout"]
    replay = plan.group(ParallelMode.REPLAY)
    assert replay is not None and replay.rank_lists == ((0, 1, 2, 3, 4),)
    wt = plan.group(ParallelMode.WEIGHT_TRANSFER)
    assert wt is not None and wt.rank_lists == ((0, 3, 4),)  # replay ranks get no weights
    assert "replay" in format_plan(plan)


@pytest.mark.parametrize(("replay", "expected"), [(2, (1, 2)), ("1-2", (1, 2)), ([], ())])
def test_replay_ranks_by_count_ranges_or_none(replay: object, expected: tuple[int, ...]) -> None:
    plan = plan_layout(LayoutSpec(world_size=4, trainers=[0], replay=replay))  # type: ignore[arg-type]
    assert plan.replay == expected
    assert plan.group(ParallelMode.REPLAY) is (None if not expected else plan.groups[-1])


def test_without_replay_ranks_the_plan_is_unchanged() -> None:
    plain = plan_layout(LayoutSpec(world_size=4, trainers=[0, 1]))
    assert plain.replay == () and plain.group(ParallelMode.REPLAY) is None
    assert plain.role(2) == "rollout"


@pytest.mark.parametrize(("kwargs", "line"), [
    (dict(replay=[0]), "layout.replay: ranks [0] are also trainers; roles must not overlap"),
    (dict(replay=[1], rollouts=[1, 2, 3]),
     "layout.replay: ranks [1] are also rollouts; roles must not overlap"),
    (dict(replay=[4]), "layout.replay: rank 4 in group [4] is out of range for world_size 4"),
    (dict(replay="2-9"), "layout.replay: rank 9 in '2-9' is out of range for world_size 4"),
    (dict(replay=0), "layout.replay: a count must be at least 1, got 0; [] means no replay "
                     "ranks"),
    (dict(replay=[1], rollouts=[2]),
     "layout: ranks [3] are neither trainers, rollouts nor replay (world_size 4)"),
], ids=["overlaps trainers", "overlaps rollouts", "out of range", "range out of range",
        "zero count", "a rank without a role"])
def test_bad_replay_ranks_are_one_line(kwargs: dict[str, object], line: str) -> None:
    with pytest.raises(LayoutError) as error:
        plan_layout(LayoutSpec(world_size=4, trainers=[0], **kwargs))  # type: ignore[arg-type]
    assert str(error.value) == line


def test_collector_i_writes_to_replay_rank_i_mod_r() -> None:
    # Static rollout ranks; elastic ones: tests/unit/test_replay_forwarding.py.
    plan = plan_layout(LayoutSpec(world_size=7, trainers=[0], replay=[1, 2], rollouts=[3, 4, 5, 6],
                                  elastic_rollouts=False))
    assert collectors(plan) == (3, 4, 5, 6)
    assert [replay_rank_of(plan, c) for c in (3, 4, 5, 6)] == [1, 2, 1, 2]
    assert writers_of(plan, 1, False) == [3, 5] and writers_of(plan, 2, False) == [4, 6]
    # Colocated trainers collect themselves: they write to the replay ranks.
    colocated = plan_layout(LayoutSpec(world_size=3, trainers=[0, 1], replay=[2], rollouts=[]))
    assert colocated.colocated and collectors(colocated) == (0, 1)
    assert writers_of(colocated, 2, False) == [0, 1]


@pytest.mark.parametrize(("batch", "replays", "shares"),
                         [(128, 1, [128]), (128, 2, [64, 64]), (10, 3, [4, 3, 3])])
def test_a_batch_is_shared_as_evenly_as_can_be(batch: int, replays: int,
                                               shares: list[int]) -> None:
    assert batch_shares(batch, replays) == shares and sum(shares) == batch


def test_a_sampled_batch_round_trips_through_its_wire_format() -> None:
    steps, envs = 4, 2
    segment_format = SegmentFormat({
        "obs": Field((steps, envs, 3), torch.float32), "actions": Field((steps, envs), torch.int64),
        "rewards": Field((steps, envs), torch.float32), "dones": Field((steps, envs), torch.float32),
        "next_obs": Field((envs, 3), torch.float32), "next_done": Field((envs,), torch.float32),
        "logp": Field((steps, envs), torch.float32)})
    segment = Segment(obs=torch.randn(steps, envs, 3), actions=torch.randint(2, (steps, envs)),
                      rewards=torch.randn(steps, envs), dones=torch.zeros(steps, envs),
                      next_obs=torch.randn(envs, 3), next_done=torch.zeros(envs),
                      logp=torch.randn(steps, envs))
    replay = Replay(ReplaySettings(capacity=16, batch_size=5, min_size=0, n_step=2,
                                   prioritized=True), {"logp": Record(())}, gamma=0.9)
    replay.insert(segment)
    batch = replay.sample(torch.Generator().manual_seed(0))
    form = batch_format(segment_format, ["logp"], 5)
    stats = torch.tensor([8.0, 5.0, 8.0, 0.0], dtype=torch.float64)
    back = form.unpack(form.pack({"obs": batch.obs, "actions": batch.actions,
                                  "rewards": batch.rewards, "next_obs": batch.next_obs,
                                  "discounts": batch.discounts, "weights": batch.weights,
                                  "indices": batch.indices, **batch.extras, "stats": stats}))
    for name, value in [("obs", batch.obs), ("actions", batch.actions),
                        ("rewards", batch.rewards), ("next_obs", batch.next_obs),
                        ("discounts", batch.discounts), ("weights", batch.weights),
                        ("indices", batch.indices), ("logp", batch.extras["logp"]),
                        ("stats", stats)]:
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name


def _validate(*overrides: str) -> None:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        validate(compose("config", overrides=list(overrides)))


def test_the_shipped_replay_layout_validates_for_an_off_policy_loop() -> None:
    _validate("loop=dqn", "layout=replay_server")
    # Elastic rollout ranks too: their trainers write the segments on (replay_service.forwards).
    _validate("loop=dqn", "layout=replay_server", "layout.elastic_rollouts=true")
    # Colocated trainers that write to a replay rank: no rollout ranks, so nothing elastic.
    _validate("loop=dqn", "layout=single", "layout.world_size=2", "layout.replay=[1]")


@pytest.mark.parametrize(("overrides", "line"), [
    (("loop=ppo", "layout=replay_server"),
     "layout.replay: ranks [1] would hold a replay, but PPOLoop does not learn from one; "
     "remove layout.replay (e.g. layout.replay=[]) or use an off-policy loop (loop=dqn, "
     "loop=sac)"),
    (("loop=dqn", "layout=replay_server", "layout.world_size=5", "layout.replay=[1,2]",
      "layout.rollouts=[3,4]", "loop.replay.batch_size=1", "loop.replay.capacity=100",
      "loop.replay.min_size=10", "loop.replay.tolerance=10"),
     "loop.replay.batch_size: 1 is fewer than the 2 replay ranks [1, 2], which each give a "
     "share of every batch; use at least 2"),
], ids=["on-policy loop", "batch smaller than the replay ranks"])
def test_replay_ranks_a_loop_cannot_use_are_refused(overrides: tuple[str, ...],
                                                    line: str) -> None:
    with pytest.raises(ConfigError) as error:
        _validate(*overrides)
    assert str(error.value) == line
