"""The replay on its own rank with elastic rollout ranks (``python -m app loop=dqn
layout=replay_server layout.elastic_rollouts=true``, docs/off-policy.md "On its own ranks"): a
collector SIGKILLed mid-run loses only what it had not sent, counted; the run goes on with the
other collector; the transitions the lost one had sent stay in the replay rank; started again,
it rejoins and writes to the replay again (through its trainer); the run ends at its budget and
every rank ends."""

from __future__ import annotations

import csv
import signal
import time
from collections.abc import Callable

import pytest

from tests.helpers.apprun import AppProcess, metrics, read_result

pytestmark = pytest.mark.e2e

SEGMENT = 128  # env steps per segment: DQN's num_envs x num_steps (loop.hparams)
KILL_AFTER_UPDATES = 6
BUDGET = 48 * 2 * SEGMENT  # about 48 updates of both collectors


def test_a_killed_collector_keeps_its_sent_transitions_in_the_replay_rank_and_rejoins(
    start_app: Callable[..., AppProcess],
) -> None:
    # One learner step of 64 per 64 transitions (samples_per_insert=1): the trainer waits on
    # its collectors, so it sees rank 3's connection close at once, before the launcher's
    # restart of rank 3 can ask to join (else the new process would replace a rank still
    # counted live, and nothing would be seen lost).
    app = start_app("replay_elastic", "loop=dqn", "layout=replay_server",
                    "layout.elastic_rollouts=true", "launcher.rollout_restarts=1", "seed=1",
                    "loop.progress=false", "loop.checkpoint_every=0",
                    f"loop.total_env_steps={BUDGET}", "loop.replay.min_size=512",
                    "loop.replay.samples_per_insert=1", "comm.timeout=60")
    app.wait_until(f"{KILL_AFTER_UPDATES} updates",
                   lambda: len(_members(app)) >= KILL_AFTER_UPDATES)
    rank = app.ranks()[3]
    assert rank.name() == "rlcomm-rank3", rank.name()
    rank.send_signal(signal.SIGKILL)
    killed = time.time()
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    assert result["status"] == "ok"
    ranks = {r["rank"]: r["result"] for r in result["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3], sorted(ranks)  # the rejoined rank 3 reported too
    trainer, server = ranks[0], ranks[1]["replay_server"]
    assert trainer["env_steps"] >= BUDGET  # the budget, not a failure, ended the run
    # The replay rank followed the trainer to the end and reports the job's counts.
    assert (ranks[1]["updates"], ranks[1]["env_steps"]) == (trainer["updates"],
                                                            trainer["env_steps"])
    (leave,) = result["leaves"]
    (join,) = result["joins"]
    seen = f"left {leave['time'] - killed:.2f} s, joined {join['time'] - killed:.2f} s after the kill"
    assert (leave["rank"], leave["reason"]) == (3, "connection closed"), (leave, seen)
    assert (join["rank"], join["reason"]) == (3, "admitted"), join
    assert ranks[3]["joined"] is True and ranks[3]["segments_sent"] > 0
    members = _members(app)
    assert [m for i, m in enumerate(members) if i == 0 or members[i - 1] != m] in (
        [2, 1, 2], [2]), members  # 1 only if an update went by before the rejoin
    # What it lost is counted, as with the replay beside the trainer
    # (tests/e2e/test_dqn.py::test_a_killed_collector_loses_only_its_unsent_transitions_counted).
    assert trainer["segments_discarded"] >= 1
    # Every segment the trainer was handed reached the replay rank in its update, before the
    # learner sampled, and the replay never lost any: its inserts and size only grow.
    rows = metrics(app.run_dir)
    assert all(r["replay_inserts"] == r["env_steps"] for r in rows), rows
    sizes = [r["replay_size"] for r in rows]
    assert sizes == sorted(sizes) and sizes[-1] == server["size"] > 0, sizes
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
