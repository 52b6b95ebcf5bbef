"""Several "hosts" on this machine (network namespaces, tests/hosts/*.sh) for multi-node tests.

Every host has its own interfaces, address (198.18.0.1x), hostname and /etc/hosts; they share
this machine's filesystem, like cluster nodes sharing a file system. Commands run "on" a host
through tests/hosts/on_host.sh; every process a test starts carries a marker, so the test can
check that none survived, on any host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from app.launch.environment import without_launcher_variables
from tests.helpers.apprun import MARKER, REPO, assert_no_survivors

SCRIPTS = REPO / "tests" / "hosts"
NS_PREFIX = "rlcomm-"


def host_ns(host: str) -> str:
    return f"{NS_PREFIX}{host}"


def netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _skip_or_fail(reason: str) -> None:
    """Without root or namespaces the multi-node tests skip; on CI (root) they must run."""
    if os.environ.get("CI") == "true" and os.geteuid() == 0:
        pytest.fail(f"CI runs as root, so the multi-node tests must run: {reason}")
    pytest.skip(reason)


@contextmanager
def hosts_up(count: int) -> Iterator[list[str]]:
    """``count`` hosts (host1..), torn down afterwards; no rlcomm namespace is left."""
    if os.geteuid() != 0:
        _skip_or_fail("needs root to create network namespaces (tests/hosts/hosts_up.sh)")
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        _skip_or_fail("needs iproute2 (ip) and util-linux (nsenter, unshare)")
    up = subprocess.run(["bash", str(SCRIPTS / "hosts_up.sh"), str(count)], capture_output=True,
                        text=True, timeout=60, check=False)
    if up.returncode != 0:
        subprocess.run(["bash", str(SCRIPTS / "hosts_down.sh")], capture_output=True, timeout=60)
        _skip_or_fail(f"could not create network namespaces: {up.stderr.strip()[-500:]}")
    try:
        yield [f"host{i}" for i in range(1, count + 1)]
    finally:
        down = subprocess.run(["bash", str(SCRIPTS / "hosts_down.sh")], capture_output=True,
                              text=True, timeout=60, check=False)
        assert down.returncode == 0, down.stderr
        assert not [ns for ns in netns_list() if ns.startswith(NS_PREFIX)]


@dataclass
class HostRun:
    host: str
    proc: subprocess.Popen[str]
    stdout: str = ""
    stderr: str = ""

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode


def start_on_host(host: str, args: Sequence[str], cwd: Path, marker: str,
                  env: dict[str, str] | None = None) -> HostRun:
    full_env = {**without_launcher_variables(os.environ), MARKER: marker, "PYTHONPATH": str(REPO),
                **(env or {})}
    proc = subprocess.Popen(["bash", str(SCRIPTS / "on_host.sh"), host, *args], cwd=cwd,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return HostRun(host, proc)


def finish(runs: Sequence[HostRun], marker: str, timeout: float) -> list[HostRun]:
    """Wait for every host's command (killing all of them past ``timeout``); no survivors."""
    deadline = time.monotonic() + timeout
    try:
        for run in runs:
            try:
                run.stdout, run.stderr = run.proc.communicate(
                    timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in runs:
                    other.proc.kill()
                run.stdout, run.stderr = run.proc.communicate()
    finally:
        assert_no_survivors(marker)
    return list(runs)


def torchrun(nnodes: int, nproc: int, endpoint: str, rdzv_id: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, "-m", "app"]


def run_torchrun(hosts: Sequence[str], nproc: int, app_args: Sequence[str], cwd: Path,
                 timeout: float = 240, port: int = 29400) -> tuple[list[HostRun], Path]:
    """One torchrun per host (rendezvous on the first host), as a user would; returns the runs
    and the run dir every rank shares (named after the rendezvous id)."""
    marker, rdzv_id = uuid.uuid4().hex, f"mn{uuid.uuid4().hex[:8]}"
    args = [*torchrun(len(hosts), nproc, f"{hosts[0]}:{port}", rdzv_id), *app_args]
    runs = [start_on_host(h, args, cwd, marker) for h in hosts]
    return finish(runs, marker, timeout), cwd / "outputs" / "runs" / f"torchrun-{rdzv_id}"


def kill_host(host: str) -> list[int]:
    """SIGKILL every process of ``host`` (its whole network namespace), as if it crashed."""
    out = subprocess.run(["ip", "netns", "pids", host_ns(host)], capture_output=True, text=True,
                         check=True)
    pids = [int(p) for p in out.stdout.split()]
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, 9)
    return pids


def set_link(host: str, up: bool) -> None:
    """Plug ``host``'s cable out of (or back into) the switch."""
    subprocess.run(["ip", "-n", f"{NS_PREFIX}switch", "link", "set", f"rlc-{host}",
                    "up" if up else "down"], check=True)


def link_bytes(host: str) -> tuple[int, int]:
    """(rx, tx) bytes of the host's eth0, as its own network namespace counts them."""
    out = subprocess.run(["ip", "-n", host_ns(host), "-s", "-j", "link", "show", "eth0"],
                         capture_output=True, text=True, check=True)
    stats = json.loads(out.stdout)[0]["stats64"]
    return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def describe_runs(runs: Sequence[HostRun]) -> str:
    return "\n".join(f"=== {r.host}: exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n"
                     f"--- stderr\n{r.stderr[-4000:]}" for r in runs)


# --------------------------------------------------------------------------------------------
# Elastic rollout hosts: torchrun with the static rendezvous, output readable while it runs
# --------------------------------------------------------------------------------------------


def static_torchrun(nnodes: int, nproc: int, node_rank: int, master: str, port: int,
                    rdzv_id: str) -> list[str]:
    """torchrun with the static rendezvous (its default backend): node 0's agent hosts the store
    at ``master:port`` and every node's ranks follow from ``--node-rank``. There is no
    rendezvous round, so a node's torchrun started again while the job runs takes its place
    (its agent reads its ranks, assigned in the first round, from the store) without the other
    agents restarting their workers, as c10d's would when a new node waits. ``--rdzv-id`` names
    the run (TORCHELASTIC_RUN_ID: its run dir is ``torchrun-<rdzv_id>``); without it each
    host's ranks would name the run after their own agent."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc), "--node-rank", str(node_rank), "--master-addr",
            master, "--master-port", str(port), "--rdzv-id", rdzv_id, "-m", "app"]


@dataclass
class LoggedHostRun(HostRun):
    """A :class:`HostRun` whose output goes to files, so that a test can read it while it runs
    (and a long run cannot fill a pipe nobody reads)."""

    out_path: Path = Path()
    err_path: Path = Path()

    def live_stderr(self) -> str:
        return self.err_path.read_text(errors="replace") if self.err_path.exists() else ""

    def collect(self) -> None:
        self.stdout = self.out_path.read_text(errors="replace") if self.out_path.exists() else ""
        self.stderr = self.live_stderr()


def start_on_host_logged(host: str, args: Sequence[str], cwd: Path, marker: str, name: str,
                         env: dict[str, str] | None = None) -> LoggedHostRun:
    """:func:`start_on_host`, its output in ``cwd/<name>.stdout`` and ``.stderr``."""
    full_env = {**without_launcher_variables(os.environ), MARKER: marker, "PYTHONPATH": str(REPO),
                **(env or {})}
    out_path, err_path = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(["bash", str(SCRIPTS / "on_host.sh"), host, *args], cwd=cwd,
                                env=full_env, stdout=out, stderr=err, text=True)
    return LoggedHostRun(host, proc, out_path=out_path, err_path=err_path)


def finish_logged(runs: Sequence[LoggedHostRun], marker: str, timeout: float) -> list[LoggedHostRun]:
    """:func:`finish` for runs whose output went to files: it is read in afterwards."""
    try:
        finish(runs, marker, timeout)
    finally:
        for run in runs:
            run.collect()
    return list(runs)


def rank_processes(run: HostRun, run_dir: Path) -> dict[int, psutil.Process]:
    """The rank processes a host's command started, by rank: each holds its log file
    ``<run_dir>/logs/rank<N>.log`` open (an agent sets RANK after its worker starts, so the
    environment does not tell)."""
    logs = (run_dir / "logs").resolve()
    found: dict[int, psutil.Process] = {}
    try:
        procs = psutil.Process(run.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for proc in procs:
        with suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            for f in proc.open_files():
                path = Path(f.path)
                match = re.fullmatch(r"rank(\d+)\.log", path.name)
                if match and path.parent.resolve() == logs:
                    found.setdefault(int(match.group(1)), proc)
    return found
