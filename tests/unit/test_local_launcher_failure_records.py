"""Failure records (app/launch/failures.py): what a failed rank writes, what launchers read."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from app.launch.failures import (
    FailureRecord,
    classify,
    describe_failures,
    read_records,
    record_path,
    recording_failures,
)
from rlcomm.errors import CollectiveMismatchError, HangError, MembersLostError, PeerLostError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("error", "kind"), [
    (HangError("hang in GLOBAL[0,1] all_reduce #3: rank 1 never entered it"), "diagnosis"),
    (CollectiveMismatchError("collective mismatch in GLOBAL[0,1] #2"), "diagnosis"),
    (PeerLostError("rank 0 on host1: lost host2 (ranks [2,3])"), "peer_lost"),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5"),
     "peer_lost"),
    (RuntimeError("Read error [127.0.0.1]:7: Connection reset by peer"), "peer_lost"),
    (MembersLostError("0 live rollout ranks of loop.min_rollouts=1; lost: rank 1"), "peer_lost"),
    (ValueError("boom on rank 1"), "error"),
    # A diagnosis wrapped by something else is that something's error, as the launcher saw it.
    (RuntimeError("loop failed"), "error"),
])
def test_a_failure_is_classified_by_its_type_and_gloos_peer_loss_wording(
    error: BaseException, kind: str
) -> None:
    assert classify(error) == kind


def test_a_failing_block_leaves_one_record_and_reraises(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    with pytest.raises(ValueError, match="boom"), \
            recording_failures(logs, 3, attempt=1, host="h1"), \
            recording_failures(logs, 3, attempt=1, host="h1"):  # nested: written once
        raise ValueError("boom")
    record = json.loads(record_path(logs, 3).read_text())
    assert record["rank"] == 3 and record["kind"] == "error" and record["error"] == "ValueError"
    assert record["message"] == "boom" and record["attempt"] == 1 and record["host"] == "h1"
    assert list(logs.iterdir()) == [record_path(logs, 3)]  # no temporary file left behind


def test_a_clean_attempt_removes_its_ranks_stale_record_and_a_stop_is_no_failure(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    with pytest.raises(RuntimeError), recording_failures(logs, 0, attempt=0, host="h"):
        raise RuntimeError("first attempt")
    with recording_failures(logs, 0, attempt=1, host="h"):
        pass
    assert not record_path(logs, 0).exists()
    with pytest.raises(KeyboardInterrupt), recording_failures(logs, 0, attempt=1, host="h"):
        raise KeyboardInterrupt
    assert not record_path(logs, 0).exists()


def test_records_of_the_newest_attempt_are_read_and_unreadable_ones_skipped(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    for rank, attempt in ((0, 0), (1, 1), (2, 1)):
        with pytest.raises(ValueError), recording_failures(logs, rank, attempt, host="h"):
            raise ValueError(f"rank {rank}")
    (logs / "rank3.error.json").write_text("{not json")
    records = read_records(logs)
    assert sorted(records) == [1, 2]
    assert isinstance(records[1], FailureRecord) and records[1].line == "ValueError: rank 1"
    assert read_records(tmp_path / "nowhere") == {}


def _record(logs: Path, rank: int, err: Exception) -> None:
    with pytest.raises(type(err)), recording_failures(logs, rank, 0, "h"):
        raise err


def _failed(**exitcodes: int) -> ChildFailedError:
    return ChildFailedError("app", {
        int(rank[1:]): ProcessFailure(int(rank[1:]), 1000, code, "/no-error-file")
        for rank, code in exitcodes.items()
    })


def test_ranks_the_agent_stopped_after_another_failed_are_not_the_cause(tmp_path: Path) -> None:
    # A hang seen in CI: ranks 0 and 3 raised the diagnosis and wrote their records; the agent,
    # seeing rank 0 gone, SIGTERMed ranks 1 and 2 before they wrote theirs.
    hang = "hang in TRAIN_DATA_PARALLEL[0,1] all_reduce #1: rank 1 never entered it"
    for rank in (0, 3):
        _record(tmp_path / "logs", rank, HangError(hang))
    sigterm = -signal.SIGTERM
    assert describe_failures(_failed(r0=1, r1=sigterm, r2=sigterm), tmp_path) == (
        f"{hang} (logs: {tmp_path / 'logs'})")
    # SIGTERMed as DeathWatch saw it (a rank the agent did not report) is no cause either.
    assert describe_failures(_failed(r0=1), tmp_path, killed={2: "SIGTERM"}) == (
        f"{hang} (logs: {tmp_path / 'logs'})")
    # A crash still wins over the hang its peers then report.
    assert describe_failures(_failed(r0=1, r1=-signal.SIGKILL), tmp_path) == (
        f"rank 1 killed by SIGKILL (log: {tmp_path / 'logs' / 'rank1.log'})")


def test_a_rank_sigtermed_while_its_peers_only_lost_it_is_the_cause(tmp_path: Path) -> None:
    _record(tmp_path / "logs", 0, RuntimeError("[pair.cc:534] Connection closed by peer [::1]:5"))
    assert describe_failures(_failed(r0=1, r1=-signal.SIGTERM), tmp_path) == (
        f"rank 1 killed by SIGTERM (log: {tmp_path / 'logs' / 'rank1.log'})")


def test_a_rank_sigtermed_beside_one_sigkilled_is_not_the_cause(tmp_path: Path) -> None:
    # Seen in CI under load (tests/e2e/test_replay_ranks_elastic.py): trainer 1 SIGKILLed, the
    # replay rank's record says it lost a peer, and the agent reported the lead it SIGTERMed
    # (no record: it died of the stop's grace) beside rank 1.
    _record(tmp_path / "logs", 2, RuntimeError("[pair.cc:537] Read error [127.0.0.1]:5: "
                                               "Connection reset by peer"))
    killed = f"rank 1 killed by SIGKILL (log: {tmp_path / 'logs' / 'rank1.log'})"
    assert describe_failures(_failed(r0=-signal.SIGTERM, r1=-signal.SIGKILL), tmp_path) == killed
    assert describe_failures(_failed(r0=-signal.SIGTERM), tmp_path,
                             killed={1: "SIGKILL"}) == killed


def test_a_leader_that_lost_its_members_is_no_cause_beside_the_rank_that_failed(
        tmp_path: Path) -> None:
    # Whether the leader (rank 0) notices the loss and raises before the launcher stops it is a
    # race; the line is rank 1's own error either way, and the leader's only when it is alone.
    lost = MembersLostError("0 live rollout ranks of loop.min_rollouts=1, and none can join "
                            "(launcher.rollout_restarts=0); lost: rank 1 on h (connection closed)")
    _record(tmp_path / "logs", 1, RuntimeError("simulated fault after 0 steps"))
    alone = describe_failures(_failed(r1=1, r0=-signal.SIGTERM), tmp_path)
    _record(tmp_path / "logs", 0, lost)
    both = describe_failures(_failed(r0=1, r1=1), tmp_path)
    rank1 = ("rank 1 exit code 1: RuntimeError: simulated fault after 0 steps "
             f"(log: {tmp_path / 'logs' / 'rank1.log'})")
    assert alone == both == rank1
    (tmp_path / "logs" / "rank1.error.json").unlink()  # rank 1 left no record: the leader's line
    assert describe_failures(_failed(r0=1), tmp_path).startswith(
        "rank 0 exit code 1: MembersLostError: 0 live rollout ranks")


def test_a_killed_rank_seen_ending_after_its_peers_is_still_the_cause(tmp_path: Path) -> None:
    # Seen in CI under load: rank 2 SIGKILLed, its peers' records say they lost it, and the
    # agent and the first scan saw only the peers end (the forkserver told of rank 2's end last).
    for rank in (0, 1, 3):
        _record(tmp_path / "logs", rank,
                RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5"))
    killed = f"rank 2 killed by SIGKILL (log: {tmp_path / 'logs' / 'rank2.log'})"
    assert describe_failures(_failed(r0=1), tmp_path, killed={},
                             signalled={2: "SIGKILL"}) == killed
    # A rank's own error wins: a rank the agent's stop escalated to SIGKILL is not named.
    _record(tmp_path / "logs", 1, ValueError("boom"))
    assert describe_failures(_failed(r1=1), tmp_path, killed={}, signalled={2: "SIGKILL"}) == (
        f"rank 1 exit code 1: ValueError: boom (log: {tmp_path / 'logs' / 'rank1.log'})")
