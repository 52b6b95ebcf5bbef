"""Replay ranks with elastic rollout ranks, without processes (app/runtime/replay/service.py,
docs/off-policy.md "On its own ranks"): the trainers write the collectors' segments on, so the
replay ranks' writers are the trainers; every replay rank gets its share of each trainer's
segments, however many trainers there are; and a segment a trainer was handed reaches the
replay rank as the collector packed it, without what only its trainer reads."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from app.loops.dqn import DQNLoop
from app.runtime.core.algorithm import Segment
from app.runtime.core.segments import EPISODE_FIELDS, Field, SegmentFormat, with_episodes
from app.runtime.replay.messages import insert_format, packed_again
from app.runtime.replay.routing import collectors, forwarded_to, writers_of
from app.runtime.rollout.worker import as_segment
from rlcomm import LayoutPlan, LayoutSpec, plan_layout
from tests.helpers.shapes import shape_of

pytestmark = pytest.mark.unit


def test_with_elastic_rollout_ranks_the_trainers_write_to_the_replay_ranks() -> None:
    static = plan_layout(LayoutSpec(world_size=5, trainers=[0], replay=[1], rollouts=[2, 3, 4],
                                    elastic_rollouts=False))
    elastic = plan_layout(LayoutSpec(world_size=5, trainers=[0], replay=[1], rollouts=[2, 3, 4],
                                     elastic_rollouts=True))
    assert not _forwards(static) and writers_of(static, 1, _forwards(static)) == [2, 3, 4]
    assert _forwards(elastic) and writers_of(elastic, 1, _forwards(elastic)) == [0]
    assert collectors(elastic) == (2, 3, 4)  # they still collect (per-collector exploration)
    # Colocated trainers collect and write themselves: nobody comes and goes.
    colocated = plan_layout(LayoutSpec(world_size=3, trainers=[0, 1], replay=[2], rollouts=[],
                                       elastic_rollouts=True))
    assert not _forwards(colocated) and writers_of(colocated, 2, _forwards(colocated)) == [0, 1]


def _forwards(plan: LayoutPlan) -> bool:
    """Whether the trainers write the collectors' segments on: the run's shape, as the
    launcher derives it for DQN on ``plan`` (RunShape.forwards)."""
    return shape_of(plan, loop=DQNLoop()).forwards


@pytest.mark.parametrize(("trainers", "replays"), [(1, 1), (1, 2), (2, 2), (2, 3), (3, 2)])
def test_every_replay_rank_gets_its_share_of_the_trainers_segments(trainers: int,
                                                                   replays: int) -> None:
    world = 2 * trainers + replays  # a rollout rank per trainer
    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(trainers)),
                                  replay=list(range(trainers, trainers + replays)),
                                  elastic_rollouts=True))
    rounds = 6 * replays  # each trainer writes one segment per update
    counts = Counter(forwarded_to(plan, t, k) for t in plan.trainers for k in range(rounds))
    assert sorted(counts) == list(plan.replay)
    assert set(counts.values()) == {rounds * trainers // replays}  # as even as it gets


def test_a_segment_written_on_is_the_collectors_without_its_episodes() -> None:
    steps, envs = 4, 2
    collected = with_episodes(SegmentFormat({
        "version": Field((1,), torch.int64), "obs": Field((steps, envs, 3), torch.float32),
        "actions": Field((steps, envs), torch.int64), "rewards": Field((steps, envs), torch.float32),
        "dones": Field((steps, envs), torch.float32), "next_obs": Field((envs, 3), torch.float32),
        "next_done": Field((envs,), torch.float32),
        "obs_moments": Field((7,), torch.float64)}), cap=3)
    packed = collected.empty()
    generator = torch.Generator().manual_seed(0)
    packed.copy_(torch.randint(0, 256, packed.shape, dtype=torch.uint8, generator=generator))
    views = collected.unpack(packed)
    views["version"][0] = 5
    handed = as_segment(collected, packed)  # as a trainer gets it (episodes aside)
    for name in EPISODE_FIELDS:
        handed.pop(name)
    form = insert_format(collected)
    assert not set(EPISODE_FIELDS) & set(form.fields)
    written: Segment = as_segment(form, packed_again(form, handed))
    assert written.version == 5 and set(written) == set(handed)
    for name, value in handed.items():
        assert torch.equal(written[name].view(torch.uint8), value.view(torch.uint8)), name
    assert torch.equal(written.moments["obs_moments"].view(torch.uint8),
                       views["obs_moments"].view(torch.uint8))
