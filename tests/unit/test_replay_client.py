"""What an off-policy algorithm sees of its replay (app/runtime/replay/client.py): a client
handed over through the algorithm contract (``Algorithm.learn_from``) is the one it learns
from; its own shard's rate limiter is built once, for its share of the whole run's
``min_size``; the replay ranks' client asks each replay rank (its own I/O, faked here) and
counts their totals with a pure rule; and the replay ranks' sampling generators keep their
seeds (app/runtime/core/seeds.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.loops.dqn import DQN, DQNSettings
from app.runtime import UpdateInfo
from app.runtime.core.algorithm import Algorithm, AlgorithmSettings
from app.runtime.core.seeds import env_seed, replay_seed
from app.runtime.replay.buffer import ReplaySettings
from app.runtime.replay.client import LocalReplay
from tests.helpers.dqn_data import REPLAY, SPACES, segment

pytestmark = pytest.mark.unit

def test_a_replay_rank_samples_with_the_seed_it_always_had() -> None:
    assert replay_seed(7, 3) == 7 * 10_000 + 3 == env_seed(7, 3)


def test_the_algorithm_learns_from_the_client_it_was_handed() -> None:
    algorithm = DQN(DQNSettings(num_envs=4, num_steps=4), SPACES, replay=REPLAY)
    client = LocalReplay(REPLAY, algorithm.records, gamma=0.99)
    algorithm.learn_from(client)
    assert algorithm.replay is client
    module = algorithm.build()
    opt = algorithm.optimizer(module)
    for update in range(3):
        info = UpdateInfo(opt, torch.Generator().manual_seed(update), 16 * (update + 1),
                          update, 0)
        row = algorithm.update(module, module, [segment()], info)
    assert client.inserts == 48 and row["replay_inserts"] == 48
    assert client.samples == 8 * algorithm.learner_steps > 0
    with pytest.raises(RuntimeError, match="already uses a replay"):
        algorithm.learn_from(LocalReplay(REPLAY, algorithm.records, gamma=0.99))


def test_an_algorithm_without_a_replay_declares_none_and_takes_none() -> None:
    algorithm: Algorithm[AlgorithmSettings] = Algorithm(AlgorithmSettings(), SPACES)
    assert algorithm.replay_settings() is None
    with pytest.raises(TypeError, match="does not learn from a replay"):
        algorithm.learn_from(LocalReplay(REPLAY, {}, gamma=0.99))


def test_a_local_shards_limiter_is_built_once_for_its_share_of_min_size() -> None:
    replay = LocalReplay(REPLAY, {}, gamma=0.99)
    replay.insert(segment())  # 16 transitions: the whole run's min_size
    with pytest.raises(RuntimeError, match="built at the first update"):
        replay.steps_allowed()
    replay.share_among(2)  # one of 2 trainers' shards: it waits for 8
    replay.share_among(1)  # later calls keep the first limiter
    assert replay.limiter is not None and replay.limiter.min_size == 8
    # 8 past its share, one sample per insert, within a tolerance of 8: two steps of 8.
    assert replay.steps_allowed() == 2
    assert replay.figures()["samples_per_insert"] == 0.0
    replay.sample(torch.Generator().manual_seed(0))
    assert replay.figures()["samples_per_insert"] == 1.0  # 8 samples for the 8 past its share


class _ReplayRanks:
    """The replay ranks as a trainer's RemoteReplay hears them: each ALLOW answered from
    ``answers`` (learner steps, then the rank's figures), every message recorded."""

    def __init__(self, answers: dict[int, list[float]]) -> None:
        self.answers, self.told = answers, []

    def tell(self, kind: int, dst: int, group: object, count: int = 0) -> None:
        self.told.append((kind, dst))

    def recv(self, tensor: torch.Tensor, src: int, group: object, tag: int) -> int:
        tensor.copy_(torch.tensor(self.answers[src], dtype=torch.float64))
        return src


def test_the_remote_client_asks_each_replay_rank_and_counts_their_totals(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from app.runtime.core.segments import Field, SegmentFormat
    from app.runtime.replay import client as client_module
    from app.runtime.replay.client import RemoteReplay, totals_limiter
    from app.runtime.replay.messages import ALLOW
    from rlcomm import LayoutSpec, plan_layout

    plan = plan_layout(LayoutSpec(world_size=6, trainers=[0, 1], replay=[2, 3],
                                  rollouts=[4, 5], elastic_rollouts=False))
    ranks = _ReplayRanks({2: [3, 100, 40, 90, 0.5], 3: [2, 110, 44, 95, 0.3]})
    monkeypatch.setattr(client_module, "tell", ranks.tell)
    monkeypatch.setattr(client_module, "dist", SimpleNamespace(recv=ranks.recv))
    ctx: Any = SimpleNamespace(get_group=lambda mode: None, get_global_rank=lambda: 0)
    steps, envs = 4, 2
    form = SegmentFormat({"obs": Field((steps, envs, 4), torch.float32),
                          "actions": Field((steps, envs), torch.int64)})
    settings = ReplaySettings(batch_size=16, min_size=64, samples_per_insert=2.0,
                              tolerance=32.0)
    remote = RemoteReplay(ctx, plan, settings, {}, form)
    remote.load_state_dict({"inserts": 1000, "samples": 500, "max_priority": 2.0})
    assert remote.steps_allowed() == 2  # the fewest any replay rank allows
    assert ranks.told == [(ALLOW, 2), (ALLOW, 3)]
    assert (remote.inserts, remote.samples, remote.size) == (1210, 584, 185)
    assert remote.insert(segment()) == 0  # the collectors wrote it to the replay ranks
    # The rule counts the replay ranks' totals, which started with this attempt.
    rule = totals_limiter(settings, replays=2, trainers=2)
    assert remote.steps_to_admit(16, 100) == rule.steps_to_admit(210, 84, 16, 100)
    figures = remote.figures()
    assert figures["samples_per_insert"] == pytest.approx(84 / (210 - 64))
    assert figures["priority_spread"] == pytest.approx(0.4)
    assert remote.state_dict() == {"inserts": 1210, "samples": 584, "max_priority": 2.0}
