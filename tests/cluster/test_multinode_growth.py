"""A job that grows across hosts (network namespaces, tests/hosts): ``python -m app.join`` on a
third host reaches the job's store at the address ``job.json`` names, and its rollout rank is
admitted, trained on, and ends with the job. Needs root, as every multi-host test."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.apprun import read_result, rows_so_far
from tests.helpers.multihost import describe_runs, finish, hosts_up, start_on_host

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def three_hosts() -> Iterator[list[str]]:
    with hosts_up(3) as names:
        yield names


def test_a_joiner_on_a_third_host_grows_a_two_host_job(three_hosts: list[str],
                                                       tmp_path: Path) -> None:
    """Trainer on host1, rollout rank on host2 (ranks started by hand); the joiner on host3."""
    marker = uuid.uuid4().hex
    trainer_host, rollout_host, joiner_host = three_hosts
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": trainer_host, "MASTER_PORT": "29581",
           "RLCOMM_RUN_ID": f"grow-{marker[:8]}"}
    app = [sys.executable, "-m", "app", "layout=1t1r", "loop.env.id=WaitingCartPole-v1",
           "loop.target_return=1e9", "loop.total_env_steps=30720", "loop.progress=false",
           "comm.timeout=60"]
    runs = [start_on_host(host, app, tmp_path, marker, env={**env, "RANK": str(rank)})
            for rank, host in enumerate((trainer_host, rollout_host))]
    run_dir = tmp_path / "outputs" / "runs" / f"grow-{marker[:8]}"
    deadline = time.monotonic() + 180
    while len(rows_so_far(run_dir)) < 2:
        assert time.monotonic() < deadline and all(r.proc.poll() is None for r in runs), \
            describe_runs(finish(runs, marker, 10))
        time.sleep(0.2)
    runs.append(start_on_host(joiner_host, [sys.executable, "-m", "app.join", str(run_dir),
                                            "role=rollout"], tmp_path, marker))
    finish(runs, marker, 300)
    assert all(r.returncode == 0 for r in runs), describe_runs(runs)
    result = read_result(run_dir)
    (join,) = result["joins"]
    assert (join["rank"], join["reason"], join["host"]) == (2, "beyond the plan", joiner_host)
    assert join["first_trained_s"] is not None, join
    reports = {r["rank"]: r for r in result["ranks"]}
    assert reports[2]["host"] == joiner_host and reports[2]["result"]["segments_sent"] > 0
    members = [int(float(row["members"])) for row in rows_so_far(run_dir)]
    assert members[0] == 1 and members[-1] == 2, members
