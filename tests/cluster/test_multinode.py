"""Multi-node for real: hosts are network namespaces on this machine (tests/hosts/*.sh), each
with its own interfaces, address, hostname and /etc/hosts; ranks on different hosts talk over
veth links through a bridge, never over loopback.

Needs root (skips otherwise; under CI=true as root they must run). The hosts exist for this
module only: the fixture tears them down and checks that no namespace is left.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.apprun import assert_commcheck_passed, checkpointed, read_result
from tests.helpers.multihost import (
    SCRIPTS,
    describe_runs,
    finish,
    finish_logged,
    hosts_up,
    kill_host,
    link_bytes,
    netns_list,
    rank_processes,
    run_torchrun,
    set_link,
    start_on_host,
    start_on_host_logged,
    static_torchrun,
    torchrun,
)

pytestmark = pytest.mark.cluster

FAST_COMMCHECK = ("loop=commcheck", "loop.latency_iters=3", "loop.bandwidth_bytes=1048576",
                  "loop.bandwidth_iters=2", "comm.timeout=60")


@pytest.fixture(scope="module")
def three_hosts() -> Iterator[list[str]]:
    with hosts_up(3) as names:
        yield names


@pytest.fixture
def hosts(three_hosts: list[str]) -> list[str]:
    """Most tests use two of the three hosts."""
    return three_hosts[:2]


def groups_of(result: dict, mode: str) -> dict[int, list[int]]:
    return {r["rank"]: r["groups"][mode]["ranks"] for r in result["ranks"] if mode in r["groups"]}


def ranks_by_host(result: dict) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for report in sorted(result["ranks"], key=lambda r: r["rank"]):
        found.setdefault(report["host"], []).append(report["rank"])
    return found


# --------------------------------------------------------------------------------------------
# The hosts script
# --------------------------------------------------------------------------------------------


def test_hosts_are_separate_machines_with_their_own_names(hosts: list[str]) -> None:
    again = subprocess.run(["bash", str(SCRIPTS / "hosts_up.sh"), "3"], capture_output=True,
                           text=True, timeout=60, check=False)
    assert again.returncode == 0 and "already up" in again.stderr  # idempotent
    probe = "import socket; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))"
    seen = {}
    for host in hosts:
        out = subprocess.run(["bash", str(SCRIPTS / "on_host.sh"), host, sys.executable, "-c",
                              probe], capture_output=True, text=True, timeout=30, check=True)
        seen[host] = out.stdout.split()
    assert seen == {"host1": ["host1", "198.18.0.11"], "host2": ["host2", "198.18.0.12"]}
    assert "198.18.0." not in subprocess.run(["ip", "route", "show", "table", "all"],
                                             capture_output=True, text=True).stdout


def test_hosts_up_refuses_a_range_in_use() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    # A private network namespace where 198.18.0.5 is taken: the script must refuse there and
    # create nothing (the machine's own namespace is not touched).
    script = ("ip link set lo up && ip addr add 198.18.0.5/32 dev lo && "
              f"RLCOMM_HOSTS_STATE=/tmp/rlcomm-hosts-refuse-{uuid.uuid4().hex[:6]} "
              f"bash {SCRIPTS / 'hosts_up.sh'} 2")
    before = netns_list()
    proc = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode != 0
    assert "198.18.0.0/24 is already in use on this machine" in proc.stderr
    assert netns_list() == before


# --------------------------------------------------------------------------------------------
# torchrun across hosts
# --------------------------------------------------------------------------------------------


def test_torchrun_two_hosts_commcheck_groups_follow_the_hosts(
    hosts: list[str], tmp_path: Path
) -> None:
    before = {h: link_bytes(h) for h in hosts}
    runs, run_dir = run_torchrun(hosts, 2, ["layout=2x2", *FAST_COMMCHECK], tmp_path)
    assert all(r.returncode == 0 for r in runs), describe_runs(runs)
    result = read_result(run_dir)
    assert_commcheck_passed(result, 4)
    placed = ranks_by_host(result)
    assert sorted(placed.values()) == [[0, 1], [2, 3]] and set(placed) == set(hosts)
    intra = groups_of(result, "INTRA_NODE")
    for host, ranks in placed.items():
        assert all(intra[r] == ranks for r in ranks), (host, intra)
    inter = groups_of(result, "INTER_NODE")
    assert inter == {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    # gloo's sockets were put on the interface that reaches the other host, and said so
    for rank in range(4):
        text = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "rlcomm set GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0" in text
    # ... and the bytes went over the hosts' links: each bandwidth broadcast (1 warm-up + 2
    # timed, 1 MiB) of a group that spans both hosts delivered at least one copy to the host
    # that does not hold its leader
    host_of = {r["rank"]: r["host"] for r in result["ranks"]}
    spanning = {(mode, tuple(info["ranks"])) for r in result["ranks"]
                for mode, info in r["groups"].items()
                if len({host_of[x] for x in info["ranks"]}) > 1}
    assert len(spanning) == 4  # GLOBAL, INTER_NODE x2, TRAIN_DATA_PARALLEL
    expected = len(spanning) * 3 * 1048576
    received = sum(link_bytes(h)[0] - before[h][0] for h in hosts)
    assert received >= expected, (received, expected)


def test_torchrun_three_hosts_one_rank_each(three_hosts: list[str], tmp_path: Path) -> None:
    runs, run_dir = run_torchrun(
        three_hosts, 1,
        ["layout=1t1r", "layout.world_size=3", "layout.rollouts=[1,2]", *FAST_COMMCHECK],
        tmp_path, port=29430)
    assert all(r.returncode == 0 for r in runs), describe_runs(runs)
    result = read_result(run_dir)
    assert_commcheck_passed(result, 3)
    assert sorted(ranks_by_host(result)) == three_hosts
    assert groups_of(result, "INTRA_NODE") == {0: [0], 1: [1], 2: [2]}  # the layout left nodes open
    assert groups_of(result, "INTER_NODE") == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}


def test_torchrun_two_hosts_ppo_trainers_on_one_host_rollouts_on_the_other(
    hosts: list[str], tmp_path: Path
) -> None:
    before = {h: link_bytes(h) for h in hosts}
    runs, run_dir = run_torchrun(
        hosts, 2,
        ["layout=2n_split", "loop.total_env_steps=20480", "loop.target_return=1e9",
         "loop.progress=false", "loop.hparams.hidden_size=256", "comm.timeout=60"],
        tmp_path)
    assert all(r.returncode == 0 for r in runs), describe_runs(runs)
    result = read_result(run_dir)
    reports = {r["rank"]: r for r in result["ranks"]}
    trainer_host, rollout_host = reports[0]["host"], reports[2]["host"]
    assert reports[1]["host"] == trainer_host and reports[3]["host"] == rollout_host
    assert trainer_host != rollout_host
    assert all(reports[r]["result"]["updates"] == 10 for r in range(4))
    weights = sum(reports[r]["result"]["weight_bytes_sent"] for r in (0, 1))
    trajectories = sum(reports[r]["result"]["trajectory_bytes_sent"] for r in (2, 3))
    assert weights > 2_000_000 and trajectories > 500_000  # 10 updates of a 256-wide MLP
    rx = link_bytes(rollout_host)[0] - before[rollout_host][0]
    tx = link_bytes(rollout_host)[1] - before[rollout_host][1]
    assert rx >= weights, (rx, weights)  # every weight transfer crossed into the rollout host
    assert tx >= trajectories, (tx, trajectories)  # every trajectory crossed out of it


# --------------------------------------------------------------------------------------------
# Where the ranks land must match the layout's nodes (ranks started by hand: RANK/WORLD_SIZE)
# --------------------------------------------------------------------------------------------


def start_ranks_by_hand(placement: dict[int, str], app_args: list[str], cwd: Path,
                        marker: str, port: int,
                        host_env: dict[str, dict[str, str]] | None = None) -> list:
    """``python -m app`` once per rank, rank r on host ``placement[r]`` (the env join mode);
    ``host_env``: more variables for the ranks of a host."""
    world = len(placement)
    env = {"WORLD_SIZE": str(world), "MASTER_ADDR": placement[0], "MASTER_PORT": str(port),
           "RLCOMM_RUN_ID": f"byhand-{marker[:8]}"}
    return [start_on_host(host, [sys.executable, "-m", "app", *app_args], cwd, marker,
                          env={**env, "RANK": str(rank), **(host_env or {}).get(host, {})})
            for rank, host in sorted(placement.items())]


def test_cyclic_placement_against_a_layout_with_nodes_is_one_clear_error(
    hosts: list[str], tmp_path: Path
) -> None:
    marker = uuid.uuid4().hex
    cyclic = {0: "host1", 1: "host2", 2: "host1", 3: "host2"}
    runs = finish(start_ranks_by_hand(cyclic, ["layout=2x2", *FAST_COMMCHECK], tmp_path, marker,
                                      29501), marker, 120)
    expected = ("error: layout: the layout's nodes [0,1] [2,3] do not match the hosts the ranks "
                "run on (host1: [0,2]; host2: [1,3])")
    for run in runs:
        assert run.returncode == 2, describe_runs(runs)
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(expected), describe_runs(runs)
    assert not (tmp_path / "outputs" / "runs" / f"byhand-{marker[:8]}" / "result.json").exists()


def test_a_layout_that_leaves_nodes_open_follows_the_hosts(hosts: list[str], tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    cyclic = {0: "host1", 1: "host2", 2: "host1", 3: "host2"}
    runs = finish(start_ranks_by_hand(cyclic, ["layout=2t2r", *FAST_COMMCHECK], tmp_path, marker,
                                      29502), marker, 120)
    assert all(r.returncode == 0 for r in runs), describe_runs(runs)
    result = read_result(tmp_path / "outputs" / "runs" / f"byhand-{marker[:8]}")
    assert_commcheck_passed(result, 4)
    assert {r["rank"]: r["host"] for r in result["ranks"]} == cyclic
    assert groups_of(result, "INTRA_NODE") == {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    assert groups_of(result, "INTER_NODE") == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}


def test_all_ranks_on_one_host_while_the_layout_says_two_nodes_is_an_error(
    hosts: list[str], tmp_path: Path
) -> None:
    marker = uuid.uuid4().hex
    runs = finish([start_on_host("host1", [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        "-m", "app", "layout=2x2", *FAST_COMMCHECK], tmp_path, marker)], marker, 120)
    assert runs[0].returncode != 0
    assert ("error: layout: the layout's nodes [0,1] [2,3] do not match the hosts the ranks run "
            "on (host1: [0,1,2,3])") in runs[0].stderr, describe_runs(runs)


# --------------------------------------------------------------------------------------------
# A lost host: killed, or its link down
# --------------------------------------------------------------------------------------------

# Static groups: a lost host ends the run (elastic rollout ranks, the default, are dropped
# instead: test_a_killed_rollout_host_is_waited_for_and_its_restart_rejoins...).
LONG_PPO = ["layout=2n_split", "layout.elastic_rollouts=false", "loop.total_env_steps=100000000",
            "loop.target_return=1e9", "loop.progress=false", "loop.checkpoint_every=2"]
TIMEOUT_S = 15


def start_long_ppo(hosts: list[str], tmp_path: Path) -> tuple[list, str, Path]:
    """PPO across the hosts, torchrun per host; returns once it has trained a few updates."""
    marker, rdzv_id = uuid.uuid4().hex, f"mn{uuid.uuid4().hex[:8]}"
    args = [*torchrun(2, 2, f"{hosts[0]}:29410", rdzv_id), *LONG_PPO, f"comm.timeout={TIMEOUT_S}"]
    runs = [start_on_host(h, args, tmp_path, marker) for h in hosts]
    run_dir = tmp_path / "outputs" / "runs" / f"torchrun-{rdzv_id}"
    deadline = time.monotonic() + 150
    while not checkpointed(run_dir / "checkpoints", 4):
        if time.monotonic() > deadline or any(r.proc.poll() is not None for r in runs):
            finish(runs, marker, 5)
            pytest.fail(f"the run did not reach update 4\n{describe_runs(runs)}")
        time.sleep(0.5)
    return runs, marker, run_dir


def assert_survivor_names_the_lost_host(run, lost: str, lost_ranks: str, ended_s: float) -> None:
    assert run.returncode not in (0, None), describe_runs([run])
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors, describe_runs([run])
    for line in errors:
        assert f": lost {lost} (ranks {lost_ranks}): " in line, describe_runs([run])
    assert ended_s <= TIMEOUT_S + 12, f"survivors took {ended_s:.1f}s"


def test_a_killed_host_ends_the_run_with_one_line_naming_it(hosts: list[str], tmp_path: Path) -> None:
    runs, marker, _ = start_long_ppo(hosts, tmp_path)
    kill_host("host2")
    killed = time.monotonic()
    survivor = runs[0]
    try:
        survivor.stdout, survivor.stderr = survivor.proc.communicate(timeout=TIMEOUT_S + 30)
    finally:
        ended = time.monotonic() - killed
        finish(runs, marker, 10)
    assert_survivor_names_the_lost_host(survivor, "host2", "[2,3]", ended)
    # Whichever of host1's ranks finds it first (torchrun's agent may stop the other before it
    # prints), from the socket host2's death closed.
    assert re.search(r"error: rank [01] on host1: lost host2 \(ranks \[2,3\]\): "
                     r"(Connection closed by peer|Read error|Connection reset)", survivor.stderr), \
        describe_runs([survivor])


def test_a_host_whose_link_goes_down_ends_the_run_with_one_line_naming_it(
    hosts: list[str], tmp_path: Path
) -> None:
    runs, marker, run_dir = start_long_ppo(hosts, tmp_path)
    set_link("host2", up=False)
    down = time.monotonic()
    survivor = runs[0]
    records = [run_dir / "logs" / f"rank{rank}.error.json" for rank in (2, 3)]
    try:
        survivor.stdout, survivor.stderr = survivor.proc.communicate(timeout=TIMEOUT_S + 45)
        ended = time.monotonic() - down
        # host2's ranks, cut off from the rendezvous store on host1, find that out with the
        # link still down (their store calls are bounded: docs/clusters.md).
        while not all(r.exists() for r in records) and time.monotonic() - down < TIMEOUT_S + 40:
            time.sleep(0.2)
        cut_off_s = time.monotonic() - down
    finally:
        set_link("host2", up=True)
        finish(runs, marker, 90)  # host2's agent ends once it reaches host1 again: nobody there
    assert_survivor_names_the_lost_host(survivor, "host2", "[2,3]", ended)
    assert "Timed out" in survivor.stderr
    assert cut_off_s < TIMEOUT_S + 40, describe_runs(runs)
    for record in records:
        assert json.loads(record.read_text())["message"].startswith(
            f"{record.name[:5].replace('rank', 'rank ')} on host2: lost host1 (ranks [0,1]): "
        ), describe_runs(runs)


def test_a_restarted_host_rejoins_and_the_run_resumes_from_its_checkpoint(
    hosts: list[str], tmp_path: Path
) -> None:
    """torchrun --max-restarts 1 on both hosts; host2 dies with all its processes (agent
    included) and is started again by hand, as a requeued node would be: host1's agent restarts
    its ranks, host2's new torchrun rejoins the rendezvous, and every rank resumes from the
    newest checkpoint and finishes the run."""
    updates = 48  # room, on a fast machine, for host2 to be killed after update 4 and before the end
    marker, rdzv_id = uuid.uuid4().hex, f"mn{uuid.uuid4().hex[:8]}"
    launcher = torchrun(2, 2, f"{hosts[0]}:29450", rdzv_id)
    launcher[3:3] = ["--max-restarts", "1"]
    args = [*launcher, "layout=2n_split", "layout.elastic_rollouts=false",
            f"loop.total_env_steps={updates * 2048}",
            "loop.target_return=1e9", "loop.progress=false", "loop.checkpoint_every=2",
            f"comm.timeout={TIMEOUT_S}", "launcher.max_restarts=1"]
    # torch 2.13's agents share one store across rounds, which a new agent cannot join.
    rejoinable = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    runs = [start_on_host(h, args, tmp_path, marker, rejoinable) for h in hosts]
    run_dir = tmp_path / "outputs" / "runs" / f"torchrun-{rdzv_id}"
    checkpoints = run_dir / "checkpoints"
    deadline = time.monotonic() + 150
    try:
        while not checkpointed(checkpoints, 4):
            assert time.monotonic() < deadline and runs[1].proc.poll() is None, "no checkpoint"
            time.sleep(0.2)
        kill_host("host2")
        runs[1].proc.wait(timeout=30)
        runs.append(start_on_host("host2", args, tmp_path, marker, rejoinable))
    finally:
        finish(runs, marker, 240)
    survivor, _, rejoined = runs
    assert survivor.returncode == 0 and rejoined.returncode == 0, describe_runs(runs)
    # host1's ranks first failed naming the lost host (one of them, at least: the agent stops
    # the other once one fails), then its agent restarted them.
    assert re.search(r"error: rank [01] on host1: lost host2 \(ranks \[2,3\]\)", survivor.stderr), \
        describe_runs(runs)
    result = read_result(run_dir)
    assert {r["rank"]: r["result"]["updates"] for r in result["ranks"]} == dict.fromkeys(
        range(4), updates)
    assert result["summary"]["restarts"] == 1  # rank 0's agent restarted its ranks once
    resumed = {r: re.findall(r"resumed from \S+ckpt_(\d+)\.pt at update (\d+)",
                             (run_dir / "logs" / f"rank{r}.log").read_text()) for r in range(4)}
    (name, at), = resumed[0]
    assert all(found == [(name, at)] for found in resumed.values()), resumed
    assert 4 <= int(at) < updates and int(name) == int(at), resumed
    assert ranks_by_host(result) == {"host1": [0, 1], "host2": [2, 3]}


def test_a_hang_across_hosts_names_the_rank_that_never_entered(
    hosts: list[str], tmp_path: Path
) -> None:
    # rank 2 sits in its own code while everyone else waits in a GLOBAL all_reduce that spans
    # both hosts: the diagnosis travels through the rendezvous store, across the hosts.
    timeout_s = 10
    runs, run_dir = run_torchrun(
        hosts, 2,
        ["layout=2x2", "loop=custom", "loop._target_=tests.helpers.hang_loops.Hang", "+loop.fault=sleep",
         "+loop.rank=2", "+loop.mode=GLOBAL", "+loop.max_wait_s=90", f"comm.timeout={timeout_s}"],
        tmp_path, timeout=150, port=29440)
    assert all(r.returncode not in (0, None) for r in runs), describe_runs(runs)
    errors = [line for r in runs for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors, describe_runs(runs)
    for line in errors:
        assert re.fullmatch(
            r"error: hang in GLOBAL\[0,1,2,3\] all_reduce #\d+ \(float32\[4\], 16 B, "
            r"hang_loops\.py:\d+\): rank 2 never entered it; rank 2 is in user code at "
            r"hang_loops\.py:\d+ in _sleep \(its Python stack is in its log\)", line), line
    assert "in _sleep" in (run_dir / "logs" / "rank2.log").read_text()


# --------------------------------------------------------------------------------------------
# Which interface gloo uses
# --------------------------------------------------------------------------------------------

LOOPBACK_NAME = "rlcomm set GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0 (the rendezvous " \
    "store host1 resolves to 127.0.1.1 (loopback) here, but the job spans hosts: eth0 " \
    "(198.18.0.11) faces them)"


def debian_hosts_file(tmp_path: Path) -> dict[str, dict[str, str]]:
    """host1's /etc/hosts as Debian writes it: its own name on 127.0.1.1."""
    path = tmp_path / "hosts.host1"
    path.write_text("127.0.0.1 localhost\n127.0.1.1 host1\n198.18.0.12 host2\n")
    return {"host1": {"RLCOMM_HOSTS_FILE": str(path)}}


def test_a_store_host_whose_name_resolves_to_127_0_1_1_still_reaches_the_others(
    hosts: list[str], tmp_path: Path
) -> None:
    """On host1 its own name means 127.0.1.1; host2 knows it as 198.18.0.11. Under torchrun
    (its agent serves the store) and with ranks started by hand (rank 0 serves it), host1's
    ranks must face host2 through eth0, not listen on loopback where host2 cannot reach."""
    host_env = debian_hosts_file(tmp_path)
    marker, rdzv_id = uuid.uuid4().hex, f"mn{uuid.uuid4().hex[:8]}"
    args = [*torchrun(2, 2, "host1:29460", rdzv_id), "layout=2x2", *FAST_COMMCHECK]
    runs = finish([start_on_host(h, args, tmp_path, marker, host_env.get(h)) for h in hosts],
                  marker, 180)
    assert all(r.returncode == 0 for r in runs), describe_runs(runs)
    by_torchrun = read_result(tmp_path / "outputs" / "runs" / f"torchrun-{rdzv_id}")
    assert LOOPBACK_NAME in runs[0].stderr, describe_runs(runs)

    marker = uuid.uuid4().hex
    placement = {0: "host1", 1: "host1", 2: "host2", 3: "host2"}
    env = {h: {**host_env.get(h, {}), "LOCAL_WORLD_SIZE": "2"} for h in hosts}
    runs = finish(start_ranks_by_hand(placement, ["layout=2x2", *FAST_COMMCHECK], tmp_path,
                                      marker, 29461, env), marker, 180)
    assert all(r.returncode == 0 for r in runs), describe_runs(runs)
    by_hand = read_result(tmp_path / "outputs" / "runs" / f"byhand-{marker[:8]}")
    for result in (by_torchrun, by_hand):
        assert_commcheck_passed(result, 4)
        assert ranks_by_host(result) == {"host1": [0, 1], "host2": [2, 3]}
        assert groups_of(result, "INTRA_NODE") == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}


CHOOSE = ("import json, os, sys; from rlcomm.net.interfaces import choose_socket_interfaces; "
          "chosen = choose_socket_interfaces(sys.argv[1]); "
          "print(json.dumps([chosen, os.environ.get('GLOO_SOCKET_IFNAME'), "
          "os.environ.get('NCCL_SOCKET_IFNAME')]))")


def choose_on(host: str, master: str, **env: str) -> list:
    import json

    full_env = {k: v for k, v in os.environ.items()
                if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    out = subprocess.run(["bash", str(SCRIPTS / "on_host.sh"), host, sys.executable, "-c", CHOOSE,
                          master], capture_output=True, text=True, timeout=60, check=True,
                         env={**full_env, "PYTHONPATH": str(Path(__file__).parents[2]), **env})
    return json.loads(out.stdout)


def test_interface_is_the_one_that_reaches_the_master_unless_the_user_set_one(
    hosts: list[str]
) -> None:
    both = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert choose_on("host2", "host1") == [both, "eth0", "eth0"]
    assert choose_on("host1", "198.18.0.12") == [both, "eth0", "eth0"]
    # all ranks on this host: loopback, as on one machine
    assert choose_on("host1", "127.0.0.1") == [{"GLOO_SOCKET_IFNAME": "lo"}, "lo", None]
    # the user's settings win, each on its own
    assert choose_on("host2", "host1", GLOO_SOCKET_IFNAME="lo") == [
        {"NCCL_SOCKET_IFNAME": "eth0"}, "lo", "eth0"]
    assert choose_on("host2", "host1", NCCL_SOCKET_IFNAME="lo") == [
        {"GLOO_SOCKET_IFNAME": "eth0"}, "eth0", "lo"]



# --------------------------------------------------------------------------------------------
# Elastic rollout hosts (layout.elastic_rollouts, the default): a lost rollout host is dropped
# and the trainers go on; a new torchrun on it joins the running job. (The local launcher's
# version: tests/e2e/test_elastic_rollout_ranks.py.)
# --------------------------------------------------------------------------------------------

# Small updates (4 envs x 32 steps per rollout rank): a few per second, even on a loaded machine.
SMALL_UPDATES = ["loop.target_return=1e9", "loop.checkpoint_every=0", "loop.progress=false",
                 "loop.hparams.num_envs=4", "loop.hparams.num_steps=32"]
STEPS_PER_ROLLOUT = 4 * 32


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as handle:
        return [row for row in csv.DictReader(handle) if row.get("update")]


def column(rows: list[dict[str, str]], name: str) -> list[int]:
    return [int(float(row[name])) for row in rows]


def collapse(values: list[int]) -> list[int]:
    """Runs of equal values as one: [2, 2, 1, 1] -> [2, 1]."""
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


def wait_for(what: str, condition, runs: list, marker: str, timeout: float) -> float:
    """Polls ``condition`` until it holds (returns the seconds it took); fails, ending every
    run, when it does not within ``timeout`` or a host's command ends first."""
    start = time.monotonic()
    while not condition():
        ended = [r.host for r in runs if r.proc.poll() is not None]
        if ended or time.monotonic() - start > timeout:
            finish_logged(runs, marker, 10)
            why = f"{', '.join(ended)} ended" if ended else f"{timeout:.0f} s passed"
            pytest.fail(f"{why} before {what}\n{describe_runs(runs)}")
        time.sleep(0.1)
    return time.monotonic() - start


def test_a_killed_rollout_host_is_waited_for_and_its_restart_rejoins_without_restarting_the_trainers(
    hosts: list[str], tmp_path: Path
) -> None:
    """2n_split under torchrun with the static rendezvous: host2 (rollout ranks 2, 3) dies with
    its agent; host1's trainers keep their processes and wait for rollout ranks; a new torchrun
    on host2 joins the running job, its ranks are admitted, and the run ends normally, one
    uninterrupted count of updates, no restart and no resume."""
    timeout_s, updates = 60, 60
    marker, rdzv_id, port = uuid.uuid4().hex, f"mn{uuid.uuid4().hex[:8]}", 29480
    app_args = ["layout=2n_split", f"loop.total_env_steps={updates * 2 * STEPS_PER_ROLLOUT}",
                *SMALL_UPDATES, f"comm.timeout={timeout_s}"]

    def start(node_rank: int, name: str):
        return start_on_host_logged(
            hosts[node_rank], [*static_torchrun(2, 2, node_rank, hosts[0], port, rdzv_id),
                               *app_args], tmp_path, marker, name)

    runs = [start(0, "host1"), start(1, "host2")]
    run_dir = tmp_path / "outputs" / "runs" / f"torchrun-{rdzv_id}"
    try:
        wait_for("5 updates", lambda: len(metric_rows(run_dir)) >= 5, runs, marker, 180)
        trainers = rank_processes(runs[0], run_dir)
        assert sorted(trainers) == [0, 1], trainers
        pids = {r: (p.pid, p.create_time()) for r, p in trainers.items()}
        kill_host("host2")
        killed = time.monotonic()
        runs[1].proc.wait(timeout=30)
        # Whichever trainer was waiting for its member's segment says so (the other may have
        # had its member's last segment already: it learns of the loss from the replacement).
        waiting = re.compile(r"rank (0|1) waiting up to [\d.]+ s for rollout ranks to "
                             r"join: 0 live of loop\.min_rollouts=1; lost: rank (2|3) on host2 \(")
        logs = [run_dir / "logs" / f"rank{r}.log" for r in (0, 1)]

        def waiting_in_a_log() -> re.Match | None:
            return next((m for path in logs if path.exists()
                         for m in [waiting.search(path.read_text())] if m), None)

        wait_for("a trainer waits for rollout ranks", lambda: waiting_in_a_log() is not None,
                 runs[:1], marker, 20)
        waited_s = time.monotonic() - killed
        wait_for("the waiting line on host1's stderr",
                 lambda: waiting.search(runs[0].live_stderr()) is not None, runs[:1], marker, 10)
        rows_at_kill = len(metric_rows(run_dir))
        assert {r: (p.pid, p.create_time()) for r, p in trainers.items()} == pids
        assert all(p.is_running() for p in trainers.values())
        runs.append(start(1, "host2-again"))
        wait_for("the trainers admit the new ranks 2 and 3",
                 lambda: "rank 2 (host2) joined rank 0's group" in logs[0].read_text()
                 and "rank 3 (host2) joined rank 1's group" in logs[1].read_text(),
                 [runs[0], runs[2]], marker, timeout_s)
        rejoined_s = time.monotonic() - killed
        still = rank_processes(runs[0], run_dir)
        assert {r: (p.pid, p.create_time()) for r, p in still.items() if r in (0, 1)} == pids
    finally:
        finish_logged(runs, marker, 240)
    survivor, _, rejoined = runs
    assert survivor.returncode == 0 and rejoined.returncode == 0, describe_runs(runs)
    assert waited_s < 15, f"a trainer said it waits {waited_s:.1f} s after the kill"
    assert rejoined_s < timeout_s
    said = waiting_in_a_log()
    assert said is not None and (int(said[1]), int(said[2])) in ((0, 2), (1, 3)), said
    assert waiting.search(survivor.stderr)
    result = read_result(run_dir)
    assert result["summary"]["restarts"] == 0
    leaves = sorted((c["rank"], c["reason"], c["host"]) for c in result["leaves"])
    assert [(r, h) for r, _, h in leaves] == [(2, "host2"), (3, "host2")], result["leaves"]
    noticed = [why for _, why, _ in leaves
               if why == "connection closed" or why.startswith("timed out")]
    # the one a trainer waited for, at least; the other's trainer may have found it replaced
    assert noticed and all(why in (*noticed, "replaced by a new process")
                           for _, why, _ in leaves), leaves
    joins = sorted((c["rank"], c["reason"], c["host"]) for c in result["joins"])
    assert joins == [(2, "admitted", "host2"), (3, "admitted", "host2")], result["joins"]
    # Epoch 1 with the joiner; or, for a trainer that learnt of its loss only after the job
    # had a live rollout rank again (served meanwhile by the other's), epoch 1 without it and
    # epoch 2 with it.
    assert all(c["epoch"] in (1, 2) for c in result["joins"]), result["joins"]
    # the trainers kept their processes and state: one count of updates, never back
    rows = metric_rows(run_dir)
    assert column(rows, "update") == list(range(1, len(rows) + 1))
    assert len(rows) > rows_at_kill and len(rows) == result["summary"]["updates"]
    # A waiting trainer writes no row: the row of 0 members may be missing.
    assert collapse(column(rows, "members")) in ([2], [2, 0, 2], [2, 1, 2]), column(rows, "members")
    epochs = column(rows, "epoch")
    assert epochs == sorted(epochs) and epochs[0] == 0 and epochs[-1] >= 1, epochs
    for rank in (0, 1):
        text = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "resumed from" not in text
    reports = {r["rank"]: r for r in result["ranks"]}
    assert sorted(reports) == [0, 1, 2, 3]
    assert {reports[r]["host"] for r in (2, 3)} == {"host2"}
    for r in (2, 3):
        assert reports[r]["result"]["joined"] is True
        # the job's count, as every rank reports it; and the segments it sent itself
        assert reports[r]["result"]["updates"] == reports[0]["result"]["updates"]
        assert 0 < reports[r]["result"]["segments_sent"] < reports[0]["result"]["updates"]
    assert "joins the running job" in (run_dir / "logs" / "rank2.log").read_text()


def test_a_rollout_host_whose_link_goes_down_is_dropped_within_comm_timeout_and_the_others_go_on(
    three_hosts: list[str], tmp_path: Path
) -> None:
    """One rank per host (trainer 0 on host1, rollout ranks 1, 2 on host2, host3): host3's cable
    is pulled; within comm.timeout rank 0 drops rank 2, and the run goes on with rank 1 and ends.

    The ranks are started by hand (RANK, WORLD_SIZE, MASTER_ADDR/PORT: rank 0 hosts the store),
    not by torchrun: torch's agents meet in an exit barrier once their workers are done, and
    the agent of a host cut off for good never comes, so the others' torchrun would wait
    torch's fixed 300 s in it (LocalElasticAgent's exit_barrier_timeout) before exiting 0."""
    # The cable is pulled after 5 updates; `before` leaves the run room for ~100 more with both
    # rollout ranks, so that a slow pull on a loaded machine still finds the run going.
    timeout_s, before, after = 15, 100, 40
    marker, port = uuid.uuid4().hex, 29490
    budget = (before * 2 + after) * STEPS_PER_ROLLOUT  # the rest after the drop: one rollout rank
    app_args = ["layout=1t1r", "layout.world_size=3", "layout.rollouts=[1,2]",
                f"loop.total_env_steps={budget}", *SMALL_UPDATES, f"comm.timeout={timeout_s}"]
    run_id = f"byhand-{marker[:8]}"
    env = {"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": three_hosts[0],
           "MASTER_PORT": str(port), "RLCOMM_RUN_ID": run_id}
    runs = [start_on_host_logged(host, [sys.executable, "-m", "app", *app_args], tmp_path,
                                 marker, host, {**env, "RANK": str(rank)})
            for rank, host in enumerate(three_hosts)]
    run_dir = tmp_path / "outputs" / "runs" / run_id
    log0 = run_dir / "logs" / "rank0.log"
    try:
        wait_for("5 updates", lambda: len(metric_rows(run_dir)) >= 5, runs, marker, 180)
        set_link("host3", up=False)
        down = time.monotonic()
        rows_at_drop = len(metric_rows(run_dir))
        left = "rank 2 (host3) left rank 0's group ("
        wait_for("rank 0 drops rank 2", lambda: left in log0.read_text(), runs[:2], marker,
                 timeout_s + 45)
        dropped_s = time.monotonic() - down
        for run in runs[:2]:  # the budget ends the run ~10-20 s after the drop
            run.proc.wait(timeout=max(1.0, down + timeout_s + 150 - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # finish_logged reports it
    finally:
        set_link("host3", up=True)
        finish_logged(runs, marker, 90)  # host3's rank gives up on its own: nobody is left
    host1, host2, _ = runs
    assert host1.returncode == 0 and host2.returncode == 0, describe_runs(runs)
    assert dropped_s <= timeout_s + 30, dropped_s
    text = log0.read_text()
    assert re.search(r"rank 2 \(host3\) left rank 0's group \((timed out|did not answer)[^)]*\); "
                     r"1 rollout ranks go on", text), text[-3000:]
    rows = metric_rows(run_dir)
    assert column(rows, "update") == list(range(1, len(rows) + 1))
    members = column(rows, "members")
    assert collapse(members) == [2, 1], members  # and no way back: host3 stays cut off
    assert members.index(1) >= rows_at_drop and members.count(1) >= 10, members
    result = read_result(run_dir)
    (leave,) = result["leaves"]
    assert (leave["rank"], leave["host"]) == (2, "host3"), leave
    assert leave["reason"].startswith(("timed out", "did not answer")), leave
    assert leave["next_update_s"] is not None and result["joins"] == []
    assert sorted(r["rank"] for r in result["ranks"]) == [0, 1]  # rank 2 never reported
    assert result["summary"]["restarts"] == 0
