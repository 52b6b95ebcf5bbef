"""Multi-node for real: hosts are network namespaces on this machine (tests/hosts/*.sh), each
with its own interfaces, address, hostname and /etc/hosts; ranks on different hosts talk over
veth links through a bridge, never over loopback.

Needs root (skips otherwise; under CI=true as root they must run). The hosts exist for this
module only: the fixture tears them down and checks that no namespace is left.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.apprun import assert_commcheck_passed, read_result
from tests.helpers.multihost import (
    SCRIPTS,
    describe_runs,
    finish,
    hosts_up,
    kill_host,
    link_bytes,
    netns_list,
    run_torchrun,
    set_link,
    start_on_host,
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

LONG_PPO = ["layout=2n_split", "loop.total_env_steps=100000000", "loop.target_return=1e9",
            "loop.progress=false", "loop.checkpoint_every=2"]
TIMEOUT_S = 15


def start_long_ppo(hosts: list[str], tmp_path: Path) -> tuple[list, str, Path]:
    """PPO across the hosts, torchrun per host; returns once it has trained a few updates."""
    marker, rdzv_id = uuid.uuid4().hex, f"mn{uuid.uuid4().hex[:8]}"
    args = [*torchrun(2, 2, f"{hosts[0]}:29410", rdzv_id), *LONG_PPO, f"comm.timeout={TIMEOUT_S}"]
    runs = [start_on_host(h, args, tmp_path, marker) for h in hosts]
    checkpoint = tmp_path / "outputs" / "runs" / f"torchrun-{rdzv_id}" / "checkpoints" / "ckpt_000004.pt"
    deadline = time.monotonic() + 150
    while not checkpoint.exists():
        if time.monotonic() > deadline or any(r.proc.poll() is not None for r in runs):
            finish(runs, marker, 5)
            pytest.fail(f"the run did not reach update 4\n{describe_runs(runs)}")
        time.sleep(0.5)
    return runs, marker, checkpoint.parent.parent


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
    runs, marker, _ = start_long_ppo(hosts, tmp_path)
    set_link("host2", up=False)
    down = time.monotonic()
    survivor = runs[0]
    try:
        survivor.stdout, survivor.stderr = survivor.proc.communicate(timeout=TIMEOUT_S + 45)
        ended = time.monotonic() - down
    finally:
        set_link("host2", up=True)
        finish(runs, marker, 90)  # host2's agent ends once it reaches host1 again: nobody there
    assert_survivor_names_the_lost_host(survivor, "host2", "[2,3]", ended)
    assert "Timed out" in survivor.stderr
    # host2's ranks, cut off from the rendezvous store on host1, name host1
    assert "lost host1 (ranks [0,1])" in runs[1].stderr, describe_runs(runs)


def test_a_restarted_host_rejoins_and_the_run_resumes_from_its_checkpoint(
    hosts: list[str], tmp_path: Path
) -> None:
    """torchrun --max-restarts 1 on both hosts; host2 dies with all its processes (agent
    included) and is started again by hand, as a requeued node would be: host1's agent restarts
    its ranks, host2's new torchrun rejoins the rendezvous, and every rank resumes from the
    newest checkpoint and finishes the run."""
    updates = 16
    marker, rdzv_id = uuid.uuid4().hex, f"mn{uuid.uuid4().hex[:8]}"
    launcher = torchrun(2, 2, f"{hosts[0]}:29450", rdzv_id)
    launcher[3:3] = ["--max-restarts", "1"]
    args = [*launcher, "layout=2n_split", f"loop.total_env_steps={updates * 2048}",
            "loop.target_return=1e9", "loop.progress=false", "loop.checkpoint_every=2",
            f"comm.timeout={TIMEOUT_S}", "launcher.max_restarts=1"]
    # torch 2.13's agents share one store across rounds, which a new agent cannot join.
    rejoinable = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    runs = [start_on_host(h, args, tmp_path, marker, rejoinable) for h in hosts]
    run_dir = tmp_path / "outputs" / "runs" / f"torchrun-{rdzv_id}"
    checkpoints = run_dir / "checkpoints"
    deadline = time.monotonic() + 150
    try:
        while not (checkpoints / "ckpt_000004.pt").exists():
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
                         env={**full_env, "PYTHONPATH": str(Path(__file__).parent.parent), **env})
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

