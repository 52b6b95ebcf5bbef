"""A three-node SLURM cluster on this machine (tests/slurm/multinode_up.sh): slurmctld on the head
node, one slurmd per host namespace. Users submit from the head node, as on a login node; the
tasks run on host1/host2, which share this machine's file system.

Needs root (skips otherwise; under CI=true as root it must run). The cluster and its hosts exist
for this module only and are torn down at its end, before the single-node SLURM tests run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.launch.environment import without_launcher_variables
from tests.helpers.apprun import (
    MARKER,
    REPO,
    assert_commcheck_passed,
    assert_no_survivors,
    checkpointed,
    read_result,
)
from tests.helpers.multihost import _skip_or_fail, kill_host, netns_list, set_link

pytestmark = pytest.mark.cluster

SLURM_SCRIPTS = REPO / "tests" / "slurm"
ON_HOST = REPO / "tests" / "hosts" / "on_host.sh"
SLURM_CONF = "/etc/rlcomm-slurm-multinode/slurm.conf"
NODES = 3  # jobs of 2 nodes get host1 and host2 (SLURM allocates in node order)
FAST = ("loop=commcheck", "loop.latency_iters=3", "loop.bandwidth_bytes=65536",
        "loop.bandwidth_iters=1", "comm.timeout=60")


def _script(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SLURM_SCRIPTS / name), *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def partition() -> Iterator[str]:
    if os.geteuid() != 0:
        _skip_or_fail("needs root for network namespaces and the SLURM daemons")
    if not Path("/usr/sbin/slurmctld").exists():  # install once, through the single-node script
        up = _script("cluster_up.sh")
        assert up.returncode == 0, f"installing SLURM failed:\n{up.stderr[-3000:]}"
        assert _script("cluster_down.sh").returncode == 0
    up = _script("multinode_up.sh", str(NODES), timeout=120)
    try:
        assert up.returncode == 0, f"multinode_up.sh failed:\n{up.stderr[-3000:]}"
        yield up.stdout.strip().splitlines()[-1]
    finally:
        down = _script("multinode_down.sh", timeout=120)
        assert down.returncode == 0, down.stderr
        assert not [ns for ns in netns_list() if ns.startswith("rlcomm-")]


def head_env(marker: str) -> dict[str, str]:
    return {**without_launcher_variables(os.environ), "SLURM_CONF": SLURM_CONF,
            "PYTHONPATH": str(REPO), MARKER: marker}


def on_head(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """A command on the head (login) node, as a user of this cluster would type it."""
    marker = os.urandom(8).hex()
    try:
        return subprocess.run(["bash", str(ON_HOST), "head", *args], cwd=cwd,
                              env=head_env(marker), capture_output=True, text=True,
                              timeout=timeout, check=False)
    finally:
        assert_no_survivors(marker)


def only_run_dir(cwd: Path) -> Path:
    found = sorted((cwd / "outputs" / "runs").glob("slurm-*"))
    assert len(found) == 1, found
    return found[0]


def assert_nodes_are_the_hosts(result: dict) -> None:
    """INTRA_NODE = the ranks of each host, INTER_NODE spans them, as the ranks actually ran."""
    by_host: dict[str, list[int]] = {}
    for report in sorted(result["ranks"], key=lambda r: r["rank"]):
        by_host.setdefault(report["host"], []).append(report["rank"])
    assert sorted(by_host) == ["host1", "host2"]
    for report in result["ranks"]:
        assert report["groups"]["INTRA_NODE"]["ranks"] == by_host[report["host"]]
        inter = report["groups"]["INTER_NODE"]["ranks"]
        assert sorted(next(r["host"] for r in result["ranks"] if r["rank"] == x)
                      for x in inter) == ["host1", "host2"]


def test_salloc_two_nodes_two_tasks_each(partition: str, tmp_path: Path) -> None:
    proc = on_head("salloc", "-N2", "--ntasks-per-node=2", "srun", sys.executable, "-m", "app",
                   "layout=2x2", *FAST, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = read_result(only_run_dir(tmp_path))
    assert_commcheck_passed(result, 4)
    assert_nodes_are_the_hosts(result)


def test_three_nodes_one_rank_each(partition: str, tmp_path: Path) -> None:
    proc = on_head("salloc", "-N3", "--ntasks-per-node=1", "srun", sys.executable, "-m", "app",
                   "layout=1t1r", "layout.world_size=3", "layout.rollouts=[1,2]", *FAST,
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = read_result(only_run_dir(tmp_path))
    assert_commcheck_passed(result, 3)
    assert {r["rank"]: r["host"] for r in result["ranks"]} == {0: "host1", 1: "host2", 2: "host3"}
    for report in result["ranks"]:  # the layout leaves nodes open: the groups follow the hosts
        assert report["groups"]["INTRA_NODE"]["ranks"] == [report["rank"]]
        assert report["groups"]["INTER_NODE"]["ranks"] == [0, 1, 2]


def test_salloc_n4_on_two_nodes_packs_3_plus_1_and_the_layout_says_so(
    partition: str, tmp_path: Path
) -> None:
    """4-CPU nodes: SLURM fills host1 with 3 tasks first; 2x2 (two ranks per node) is then a
    clear error naming the hosts."""
    proc = on_head("salloc", "-N2", "-n4", "srun", sys.executable, "-m", "app", "layout=2x2",
                   *FAST, cwd=tmp_path)
    assert proc.returncode != 0
    assert ("error: layout: the layout's nodes [0,1] [2,3] do not match the hosts the ranks run "
            "on (host1: [0,1,2]; host2: [3])") in proc.stderr, proc.stderr[-4000:]
    assert not (only_run_dir(tmp_path) / "result.json").exists()


def test_cyclic_distribution_is_one_clear_error(partition: str, tmp_path: Path) -> None:
    proc = on_head("salloc", "-N2", "--ntasks-per-node=2", "srun", "--distribution=cyclic",
                   sys.executable, "-m", "app", "layout=2x2", *FAST, cwd=tmp_path)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 4 and len(set(lines)) == 1, proc.stderr[-4000:]  # one per rank, alike
    assert lines[0].startswith(
        "error: layout: the layout's nodes [0,1] [2,3] do not match the hosts the ranks run on "
        "(host1: [0,2]; host2: [1,3])")
    assert not (only_run_dir(tmp_path) / "result.json").exists()


def test_sbatch_example_on_two_nodes(partition: str, tmp_path: Path) -> None:
    script = REPO / "examples" / "slurm_commcheck.sbatch"
    proc = on_head("sbatch", "--parsable", "-N2", "--ntasks-per-node=2", str(script),
                   "layout=2x2", *FAST[1:], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 180
    while on_head("squeue", "-h", "-j", job, cwd=tmp_path).stdout.strip():
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(1)
    result = read_result(tmp_path / "outputs" / "runs" / f"slurm-{job}.0")
    assert_commcheck_passed(result, 4)
    assert_nodes_are_the_hosts(result)


def test_multirun_through_the_slurm_launcher_on_two_nodes(partition: str, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = on_head(sys.executable, "-m", "app", "--multirun", "hydra/launcher=rlcomm_slurm",
                   f"hydra.launcher.partition={partition}", "hydra.launcher.timeout_min=5",
                   f"hydra.sweep.dir={sweep}", "layout=2x2,2n_split", *FAST, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((sweep / "summary.json").read_text())
    assert [(j["job"], j["status"]) for j in summary["jobs"]] == [(0, "ok"), (1, "ok")]
    for job in ("0", "1"):
        result = read_result(sweep / job)
        assert_commcheck_passed(result, 4)
        assert_nodes_are_the_hosts(result)
    split = {r["rank"]: (r["host"], r["role"]) for r in read_result(sweep / "1")["ranks"]}
    assert split == {0: ("host1", "trainer"), 1: ("host1", "trainer"),
                     2: ("host2", "rollout"), 3: ("host2", "rollout")}


# --------------------------------------------------------------------------------------------
# A host lost mid-run: every process of host2 killed, its slurmd and slurmstepd included
# --------------------------------------------------------------------------------------------

LONG_PPO = ("layout=2n_split", "layout.elastic_rollouts=false",
            "loop.total_env_steps=100000000", "loop.target_return=1e9",
            "loop.progress=false", "loop.checkpoint_every=2", "comm.timeout=15")
# The ranks on host1 fail at once (their connections to host2 close); SLURM ends the job once
# host2's slurmd has missed its SlurmdTimeout (10 s) and the node is declared failed.
LOST_HOST_END_S = 60


def kill_host2_mid_run(partition: str, cwd: Path, *command: str,
                       link_down: bool = False) -> tuple[str, float]:
    """Run ``command`` on the head node, kill host2 (or take its link down) once the run has
    checkpointed update 4, and return its stderr and how long it took to end after that; the
    host is revived after."""
    marker = os.urandom(8).hex()
    proc = subprocess.Popen(["bash", str(ON_HOST), "head", *command], cwd=cwd,
                            env=head_env(marker), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 150
        while not checkpointed(cwd, 4):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        if link_down:
            set_link("host2", up=False)
        else:
            kill_host("host2")
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=LOST_HOST_END_S + 60)
        return stderr, time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if link_down:
            set_link("host2", up=True)
        # host2's ranks, cut off, end once their own comm.timeout has passed
        assert_no_survivors(marker, grace_s=30)
        up = _script("multinode_up.sh", str(NODES), timeout=120)  # slurmd-host2 again
        assert up.returncode == 0 and up.stdout.strip().endswith(partition), up.stderr[-3000:]


def test_a_killed_host_ends_the_srun_job_naming_the_lost_host(
    partition: str, tmp_path: Path
) -> None:
    stderr, ended_s = kill_host2_mid_run(
        partition, tmp_path, "salloc", "-N2", "--ntasks-per-node=2", "srun", sys.executable,
        "-m", "app", *LONG_PPO)
    assert_host1_ranks_name_the_lost_host2(stderr)
    assert "Node failure on host2" in stderr, stderr[-4000:]
    assert ended_s < LOST_HOST_END_S, f"the job took {ended_s:.0f} s to end"


def assert_host1_ranks_name_the_lost_host2(stderr: str) -> None:
    """Each rank on host1 ends with one line naming host2 and its ranks; what follows the name
    is gloo's own words, which vary with the socket call that failed (read, write, connect)."""
    errors = sorted(line for line in stderr.splitlines() if line.startswith("error: rank"))
    assert len(errors) == 2, stderr[-4000:]
    for rank, line in zip((0, 1), errors):
        assert line.startswith(f"error: rank {rank} on host1: lost host2 (ranks [2,3]): "), line


def test_a_host_whose_link_goes_down_ends_the_srun_job_naming_it(
    partition: str, tmp_path: Path
) -> None:
    stderr, ended_s = kill_host2_mid_run(
        partition, tmp_path, "salloc", "-N2", "--ntasks-per-node=2", "srun", sys.executable,
        "-m", "app", *LONG_PPO, link_down=True)
    assert_host1_ranks_name_the_lost_host2(stderr)
    assert "Node failure on host2" in stderr, stderr[-4000:]
    assert ended_s < LOST_HOST_END_S, f"the job took {ended_s:.0f} s to end"
    # host2's ranks end too (checked on leaving kill_host2_mid_run): by their own timeout, or by
    # SLURM's kill once the link is back, whichever comes first, so their last words may vary.


def test_a_killed_host_fails_its_multirun_job_which_is_named(
    partition: str, tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    stderr, ended_s = kill_host2_mid_run(
        partition, tmp_path, sys.executable, "-m", "app", "--multirun",
        "hydra/launcher=rlcomm_slurm", f"hydra.launcher.partition={partition}",
        "hydra.launcher.timeout_min=5", f"hydra.sweep.dir={sweep}", *LONG_PPO)
    assert ended_s < LOST_HOST_END_S, f"the multirun took {ended_s:.0f} s to end"
    assert re.search(r"sweep job #0 \(.*\) failed \(slurm job \d+\)", stderr), stderr[-4000:]
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["failed"] == [0]
    job, = summary["jobs"]
    assert job["status"] == "failed"
    assert "lost host2 (ranks [2,3])" in job["error"], job["error"]
    assert "ranks [2, 3] ended without reporting" in job["error"], job["error"]

