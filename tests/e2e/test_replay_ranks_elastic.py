"""The replay on its own rank with elastic rollout ranks (``python -m app loop=dqn
layout=replay_server layout.elastic_rollouts=true``, docs/off-policy.md "On its own ranks"): a
collector SIGKILLed mid-run loses only what it had not sent, counted; the run goes on with the
other collector; the transitions the lost one had sent stay in the replay rank; started again,
it rejoins and writes to the replay again (through its trainer); the run ends at its budget and
every rank ends."""

from __future__ import annotations

import csv
import signal
from collections.abc import Callable

import pytest

from tests.helpers.apprun import AppProcess, metrics, read_result

pytestmark = pytest.mark.e2e

SEGMENT = 128  # env steps per segment: DQN's num_envs x num_steps (loop.hparams)
KILL_AFTER_UPDATES = 6
ALONE_UPDATES = 2  # updates trained on the survivor's segments alone before rank 3 may restart
BUDGET = 48 * 2 * SEGMENT  # about 48 updates of both collectors


def test_a_killed_collector_keeps_its_sent_transitions_in_the_replay_rank_and_rejoins(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("replay_elastic", "loop=dqn", "layout=replay_server",
                    "layout.elastic_rollouts=true", "launcher.rollout_restarts=1", "seed=1",
                    "loop.progress=false", "loop.checkpoint_every=0",
                    f"loop.total_env_steps={BUDGET}", "loop.replay.min_size=512",
                    "comm.timeout=60")
    app.wait_until(f"{KILL_AFTER_UPDATES} updates",
                   lambda: len(_members(app)) >= KILL_AFTER_UPDATES)
    rank = app.ranks()[3]
    assert rank.name() == "rlcomm-rank3", rank.name()
    # Its slot (app/launch/slots.py) starts it again: held until the trainer has trained on
    # the survivor alone, so that the loss is seen as one (not as a replacement) and the run
    # is seen to go on without it.
    slot = rank.parent()
    assert slot is not None and slot.name() == "rlcomm-slot3", slot
    slot.suspend()
    try:
        rank.send_signal(signal.SIGKILL)
        app.wait_until(f"{ALONE_UPDATES} updates with one collector",
                       lambda: _members(app).count(1) >= ALONE_UPDATES)
    finally:
        slot.resume()
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    assert result["status"] == "ok"
    ranks = {r["rank"]: r["result"] for r in result["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3], sorted(ranks)  # the rejoined rank 3 reported too
    trainer, server = ranks[0], ranks[1]["replay_server"]
    assert trainer["env_steps"] >= BUDGET  # the budget, not a failure, ended the run
    members = _members(app)
    assert [m for i, m in enumerate(members) if i == 0 or members[i - 1] != m] == [2, 1, 2]
    assert [(c["rank"], c["reason"]) for c in result["leaves"]] == [(3, "connection closed")]
    assert [(c["rank"], c["reason"]) for c in result["joins"]] == [(3, "admitted")]
    assert ranks[3]["joined"] is True and ranks[3]["segments_sent"] > 0
    # What it lost is counted, as with the replay beside the trainer
    # (tests/e2e/test_dqn.py::test_a_killed_collector_loses_only_its_unsent_transitions_counted).
    assert trainer["segments_discarded"] >= 1
    # Every segment the trainer was handed reached the replay rank in its update, before the
    # learner sampled, and the replay never lost any: its inserts only grow.
    rows = metrics(app.run_dir)
    assert all(r["replay_inserts"] == r["env_steps"] for r in rows), rows
    assert server["inserts"] == server["segments"] * SEGMENT == trainer["env_steps"]
    # Beyond what the survivor and the rejoined process sent: what rank 3 sent before it was
    # killed, still there.
    before_kill = server["segments"] - ranks[2]["segments_sent"] - ranks[3]["segments_sent"]
    assert before_kill >= KILL_AFTER_UPDATES, (server, ranks[2], ranks[3])
    assert server["samples"] > 0 and server["batches"] > 0  # the trainer learnt from it
    app.assert_all_ended()


def _members(app: AppProcess) -> list[int]:
    """The job's live rollout ranks at each update so far (metrics.csv)."""
    path = app.run_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as handle:
        return [int(float(row["members"])) for row in csv.DictReader(handle)]
