"""An off-policy algorithm's state in checkpoints (app/runtime/checkpoints/checkpoint.py,
app/runtime/replay/offpolicy.py): the replay's counters and the learner's step count round-trip through
a verified checkpoint, a resumed shard refills to min_size before the learner steps again, and a
checkpoint of an algorithm without such state (PPO) holds no ``algorithm`` entry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.loops.dqn import DQN, DQNSettings
from app.runtime import UpdateInfo
from app.runtime.checkpoints.checkpoint import (
    TrainingState,
    newest_valid_checkpoint,
    save_checkpoint,
)
from tests.helpers.dqn_data import REPLAY, SPACES, segment

pytestmark = pytest.mark.unit

def _update(algorithm: DQN, module: torch.nn.Module, opt: torch.optim.Optimizer,
            update: int) -> dict[str, float]:
    info = UpdateInfo(opt, torch.Generator().manual_seed(update), 16 * (update + 1), update, 0)
    return algorithm.update(module, module, [segment()], info)


def test_the_replay_counters_round_trip_and_a_resume_refills(tmp_path: Path) -> None:
    settings = DQNSettings(num_envs=4, num_steps=4)
    algorithm = DQN(settings, SPACES, replay=REPLAY)
    module = algorithm.build()
    opt = algorithm.optimizer(module)
    for update in range(4):
        _update(algorithm, module, opt, update)
    saved = algorithm.state_dict()
    assert saved["replay"]["inserts"] == 64 and saved["learner_steps"] > 0
    save_checkpoint(tmp_path, module, opt, TrainingState(update=4, env_steps=64, algorithm=saved))
    state = newest_valid_checkpoint(tmp_path).state  # verified: the checksum covers it
    assert state["algorithm"] == saved

    resumed = DQN(settings, SPACES, replay=REPLAY)
    resumed.load_state_dict(state["algorithm"])
    assert (resumed.replay.inserts, resumed.replay.size) == (64, 0)
    assert resumed.learner_steps == saved["learner_steps"]
    first = _update(resumed, module, opt, 4)  # 16 transitions: min_size again
    assert first["learner_steps"] == 1.0  # the tolerance's one step, not a burst for the gap
    row = _update(resumed, module, opt, 5)
    assert row["learner_steps"] == 2.0 and row["replay_inserts"] == 96


def test_an_algorithm_without_state_writes_no_algorithm_entry(tmp_path: Path) -> None:
    module = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(module.parameters())
    save_checkpoint(tmp_path, module, opt, TrainingState(update=1, env_steps=1, algorithm={}))
    assert "algorithm" not in newest_valid_checkpoint(tmp_path).state
