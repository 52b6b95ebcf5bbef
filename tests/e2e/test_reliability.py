"""When things go wrong, through ``python -m app`` with real processes and signals.

Bad resume paths, a rank that never joins, a rank that dies or raises, an elastic restart from the
last checkpoint, SIGINT/SIGTERM on the launcher, two runs on one machine and what they listen on.
Every test that starts ranks checks that every process it started has ended (no survivors, no
orphans, no zombies). Late ranks on forked ranks are tests/integration/test_join_timeout.py;
weights that travel as data, never as pickles, tests/integration/test_weights_without_unpickling.py.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from rlcomm.testing import free_port
from tests.helpers.apprun import (
    HANG_S,
    REPO,
    AppProcess,
    describe,
    read_result,
    rows_so_far,
    run_app,
)

STOP_S = 60.0  # a failed or interrupted run must be over this soon after the event
# Small PPO steps so an update takes a fraction of a second even on 2 loaded cores.
PPO_SMALL = ("loop.hparams={num_envs:4,num_steps:64}", "loop.progress=false", "loop.target_return=1e9")
STEPS_PER_UPDATE = 2 * 4 * 64  # layout 2t2r: 2 rollout ranks x num_envs x num_steps
PPO_FOREVER = (*PPO_SMALL, f"loop.total_env_steps={10**10}")


def per_rank(result: dict[str, Any], *keys: str) -> dict[int, tuple[Any, ...]]:
    return {r["rank"]: tuple(r["result"][k] for k in keys) for r in result["ranks"]}


def user_package(tmp_path: Path, source: str) -> dict[str, str]:
    """A package ``mypkg`` outside the repo holding ``loops.py``; returns the env to find it."""
    package = tmp_path / "mypkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "loops.py").write_text(textwrap.dedent(source))
    return {"PYTHONPATH": f"{REPO}:{tmp_path}"}


# ---- 1. bad input: fails before any rank starts ----------------------------------------------


def _missing(tmp: Path) -> tuple[Path, str]:
    path = tmp / "no" / "such" / "run"
    return path, f"error: loop.resume: '{path}' does not exist"


def _empty_dir(tmp: Path) -> tuple[Path, str]:
    path = tmp / "empty_run"
    path.mkdir()
    return path, f"error: loop.resume: '{path}' holds no checkpoint (ckpt_*.pt or ckpt_*/)"


def _only_partial(tmp: Path) -> tuple[Path, str]:
    # A run killed while saving: only the temp file of its first checkpoint is there.
    path = tmp / "crashed_run"
    (path / "checkpoints").mkdir(parents=True)
    (path / "checkpoints" / "ckpt_000002.tmp").write_bytes(b"half a checkpoint")
    return path, f"error: loop.resume: '{path}' holds no checkpoint (ckpt_*.pt or ckpt_*/)"


def _not_a_checkpoint(tmp: Path) -> tuple[Path, str]:
    path = tmp / "ckpt_000001.pt"
    path.write_bytes(b"not a checkpoint")
    return path, f"error: loop.resume: '{path}' is not a readable checkpoint"


@pytest.mark.e2e
@pytest.mark.parametrize("case", [_missing, _empty_dir, _only_partial, _not_a_checkpoint],
                         ids=["missing", "empty-dir", "only-partial-tmp", "not-a-checkpoint"])
def test_bad_resume_path_fails_before_any_rank_starts(
    case: Callable[[Path], tuple[Path, str]], tmp_path: Path
) -> None:
    resume, expected = case(tmp_path)
    run_dir = tmp_path / "run"
    proc = run_app(f"loop.resume={resume}", f"hydra.run.dir={run_dir}", timeout=HANG_S)
    assert proc.returncode == 2, describe(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), describe(proc)  # one line, no trace
    assert not (run_dir / "logs").exists()  # no rank ever started


# ---- 2. a rank that never joins ------------------------------------------------------------


@pytest.mark.e2e
def test_a_rank_that_never_joins_fails_the_others_naming_it(
    start_app: Callable[..., AppProcess], tmp_path: Path
) -> None:
    timeout_s, world, port = 10, 4, free_port()
    run_dir = tmp_path / "join"

    def start(rank: int) -> AppProcess:
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        return start_app(f"rank{rank}", "loop=commcheck", f"comm.timeout={timeout_s}",
                         run_dir=run_dir, env=env)

    apps = [start(rank) for rank in range(world - 1)]  # rank 3 never starts
    pids = {app.pid for app in apps}
    # A rank creates its log just before it joins; from then on the clock is the join timeout.
    joined_at: dict[int, float] = {}
    ended_at: dict[int, float] = {}
    deadline = time.monotonic() + HANG_S
    while len(ended_at) < len(apps) and time.monotonic() < deadline:
        for rank, app in enumerate(apps):
            if rank not in joined_at and app.log_path(rank).exists():
                joined_at[rank] = time.monotonic()
            if rank not in ended_at and app.proc.poll() is not None:
                ended_at[rank] = time.monotonic()
        time.sleep(0.05)
    assert len(ended_at) == len(apps), "\n".join(a.describe() for a in apps)

    for rank, app in enumerate(apps):
        assert app.proc.returncode == 2, app.describe()
        assert app.last_line == (
            f"error: rank {rank}: ranks [3] never joined within {timeout_s}s; arrived: [0,1,2] of 4"
        ), app.describe()
        assert "Traceback" not in app.stderr, app.describe()
        waited = ended_at[rank] - joined_at.get(rank, apps[rank].started)
        assert waited < timeout_s + 30, f"rank {rank} took {waited:.1f}s to give up"
    # Every process ended and was reaped: none left anywhere, none a zombie child of ours.
    for app in apps:
        app.assert_all_ended()
    leftovers = [c for c in psutil.Process().children(recursive=True) if c.pid in pids]
    assert not leftovers, leftovers


# ---- 3. a rank that crashes mid-run ---------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(("rank", "layout"), [(0, "layout.elastic_rollouts=true"),
                                              (1, "layout.elastic_trainers=false"),
                                              (2, "layout.elastic_rollouts=false")],
                         ids=["the lead trainer", "a static trainer",
                              "a rollout rank of static groups"])
def test_sigkill_of_one_rank_stops_the_whole_run(
    start_app: Callable[..., AppProcess], rank: int, layout: str
) -> None:
    """The lead trainer's death ends the run, and so does any trainer's where trainers are
    static, or a rollout rank's where the groups are (an elastic rank is dropped instead:
    tests/e2e/test_elastic_rollout_ranks.py, tests/e2e/test_elastic_trainers.py)."""
    app = start_app("killed", *PPO_FOREVER, layout)
    app.wait_until_training()
    ranks = app.ranks()
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    ranks[rank].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    code = app.wait()
    stopped_after = time.monotonic() - killed_at
    assert stopped_after < STOP_S, f"run went on {stopped_after:.0f}s after rank {rank} died"
    assert code == 2, app.describe()
    log = app.run_dir / "logs" / f"rank{rank}.log"
    assert f"rank {rank} killed by SIGKILL (log: {log})" in app.last_line
    assert app.last_line.startswith("error: "), app.describe()
    app.assert_all_ended()


BOOM_LOOP = '''
from dataclasses import dataclass

import torch

from rlcomm import collectives


@dataclass
class Boom:
    rank: int = 1

    def __call__(self, ctx, job):
        collectives.all_reduce(ctx, "GLOBAL", torch.ones(1))  # everyone is in the loop
        if job.rank == self.rank:
            raise ValueError(f"boom on rank {job.rank}")
        # The others wait here for the rank that will never come: they must not hang.
        collectives.all_reduce(ctx, "GLOBAL", torch.ones(1))
        return {"survived": True}
'''


@pytest.mark.e2e
def test_a_loop_that_raises_on_one_rank_fails_the_run_promptly(
    start_app: Callable[..., AppProcess], tmp_path: Path
) -> None:
    env = user_package(tmp_path, BOOM_LOOP)
    # A long comm timeout: only the agent noticing the failure can end this run in time.
    app = start_app("boom", "loop=custom", "loop._target_=mypkg.loops.Boom", "comm.timeout=600", env=env)
    app.wait_until("rank 1's error in its log", lambda: "boom on rank 1" in app.log(1))
    failed_at = time.monotonic()
    code = app.wait()
    assert time.monotonic() - failed_at < STOP_S, "the other ranks hung in their collective"
    assert code == 2, app.describe()
    log1 = app.run_dir / "logs" / "rank1.log"
    assert app.last_line.startswith("error: "), app.describe()
    assert f"rank 1 exit code 1: ValueError: boom on rank 1 (log: {log1})" in app.last_line
    traceback = app.log(1)
    assert "Traceback (most recent call last)" in traceback
    assert 'raise ValueError(f"boom on rank {job.rank}")' in traceback
    assert not (app.run_dir / "result.json").exists()
    # The launcher named rank 1 from its failure record, which says what failed, typed.
    record = json.loads((app.run_dir / "logs" / "rank1.error.json").read_text())
    assert (record["rank"], record["kind"], record["error"]) == (1, "error", "ValueError")
    assert record["message"] == "boom on rank 1" and record["attempt"] == 0
    app.assert_all_ended()


# ---- 4. an elastic restart resumes from the last checkpoint ---------------------------------


@pytest.mark.e2e
def test_restart_resumes_from_the_last_checkpoint_without_loss(
    start_app: Callable[..., AppProcess],
) -> None:
    updates = 30
    # A target any policy reaches in its first updates, noted and trained past: the run's first
    # time is what the restarted run must report.
    settings = (*PPO_SMALL, f"loop.total_env_steps={updates * STEPS_PER_UPDATE}",
                "loop.checkpoint_every=2", "launcher.max_restarts=1", "loop.target_return=10",
                "loop.stop_at_target=false", "layout.elastic_trainers=false")

    clean = start_app("uninterrupted", *settings)
    assert clean.wait() == 0, clean.describe()
    expected = per_rank(read_result(clean.run_dir), "updates", "env_steps")
    assert expected == {r: (updates, updates * STEPS_PER_UPDATE) for r in range(4)}
    first_reach = read_result(clean.run_dir)["summary"]["env_steps_to_target"]
    assert first_reach is not None and first_reach <= 2 * STEPS_PER_UPDATE, first_reach
    clean.assert_all_ended()

    # A grace longer than the agent waits for the ranks it stops to restart them (30 s): a rank
    # asked to stop whose update cannot end (the lost trainer's rollout rank) must not wait it out.
    app = start_app("restarted", *settings, f"launcher.shutdown_timeout={4 * STOP_S}")
    checkpoints = app.run_dir / "checkpoints"
    app.wait_until("a first checkpoint", lambda: any(checkpoints.glob("ckpt_*.pt")))
    first = app.ranks()
    assert sorted(first) == [0, 1, 2, 3], first
    # A trainer, once: with static trainers (the restart path) every rank restarts.
    first[1].send_signal(signal.SIGKILL)
    assert app.wait() == 0, app.describe()
    assert "forcefully exiting" not in app.stderr, app.describe()  # every rank ended when asked

    result = read_result(app.run_dir)
    assert per_rank(result, "updates", "env_steps") == expected, app.describe()
    # The closing summary counts the restart (the uninterrupted run had none).
    assert read_result(clean.run_dir)["summary"]["restarts"] == 0
    assert result["summary"]["restarts"] == 1, app.describe()
    assert ", 1 restart, 4 ranks for " in app.stdout, app.describe()
    # The agent's restart notice goes through the console path too (above any progress bar).
    assert re.search(r"^\[launcher\] .*will restart worker group$", app.stderr, re.MULTILINE), \
        app.describe()
    resumed = {r: re.findall(r"resumed from \S+ckpt_(\d+)\.pt at update (\d+)", app.log(r))
               for r in range(4)}
    assert all(len(found) == 1 for found in resumed.values()), (resumed, app.describe())
    (name, at), = resumed[0]
    assert all(found == [(name, at)] for found in resumed.values()), resumed
    assert 2 <= int(at) < updates and int(name) == int(at), resumed  # a real mid-run resume
    # The run's history survived the restart: the target was first reached before the
    # checkpoint it resumed from, and the summary says when, not when the resumed run saw it.
    summary = result["summary"]
    assert summary["env_steps_to_target"] == first_reach, (summary, app.describe())
    assert summary["time_to_target_s"] > 0, summary
    assert not list(checkpoints.glob("*.tmp")), list(checkpoints.iterdir())
    assert (checkpoints / f"ckpt_{updates:06d}.pt").exists()
    app.assert_all_ended()
    # metrics.csv holds every update once: rows up to the checkpoint travel in it.
    with (app.run_dir / "metrics.csv").open() as handle:
        logged = [int(float(row["update"])) for row in csv.DictReader(handle)]
    assert logged == list(range(1, updates + 1)), logged


# ---- 5. SIGINT / SIGTERM on the launcher ----------------------------------------------------


@pytest.mark.e2e
def test_sigint_sigterm_and_ctrl_c_stop_every_rank_then_a_new_run_starts_cleanly(
    start_app: Callable[..., AppProcess],
) -> None:
    # Each run starts right after the previous one was interrupted. `kill -INT|-TERM <pid>` (or a
    # scheduler) signals the launcher only; Ctrl-C in a terminal signals every process of the job.
    for how, sig in (("kill", signal.SIGINT), ("kill", signal.SIGTERM), ("ctrl-c", signal.SIGINT)):
        app = start_app(f"{how}-{sig.name}", *PPO_FOREVER)
        app.wait_until_training()
        ranks = app.ranks()
        assert sorted(ranks) == [0, 1, 2, 3], ranks
        if how == "kill":
            os.kill(app.pid, sig)
        else:
            os.killpg(app.pid, sig)  # the app leads its own session: this is its process group
        sent_at = time.monotonic()
        code = app.wait()
        assert time.monotonic() - sent_at < STOP_S, app.describe()
        assert code == 128 + sig, app.describe()
        assert app.last_line == (
            f"error: interrupted by {sig.name}: stopped all 4 ranks (logs: {app.run_dir / 'logs'})"
        ), app.describe()
        assert "SignalException" not in app.stderr, app.describe()
        app.assert_all_ended()

    again = start_app("again", "loop=commcheck", "loop.bandwidth_bytes=65536")
    assert again.wait() == 0, again.describe()
    assert read_result(again.run_dir)["status"] == "ok"
    again.assert_all_ended()


@pytest.mark.e2e
@pytest.mark.parametrize("signals", [1, 2], ids=["once", "twice"])
def test_an_interrupted_multirun_stops_at_the_interrupted_job(
    start_app: Callable[..., AppProcess], tmp_path: Path, signals: int
) -> None:
    # A second SIGTERM (a scheduler's, then the user's) while the ranks are being stopped cuts
    # nothing short and does not let the sweep go on.
    sweep = tmp_path / "sweep"
    app = start_app("sweep", "--multirun", "layout=1t1r", "seed=0,1", *PPO_FOREVER,
                    f"hydra.sweep.dir={sweep}")
    first = sweep / "0" / "logs"
    app.wait_until("job 0 training", lambda: all(
        (first / f"rank{r}.log").exists() and "groups:" in (first / f"rank{r}.log").read_text()
        for r in range(2)))
    for _ in range(signals):
        os.kill(app.pid, signal.SIGTERM)
        time.sleep(0.5)
    assert app.wait() == 128 + signal.SIGTERM, app.describe()
    assert app.last_line == f"error: interrupted by SIGTERM: stopped all 2 ranks (logs: {first})"
    assert not (sweep / "1").exists(), "the sweep went on after the interrupt"
    app.assert_all_ended()


# The launcher stalls right after it started its ranks, before torch's agent holds them (as a
# launcher starved on a loaded machine does): a signal then finds an agent with nothing to stop.
STALLED_AGENT = """
import importlib, runpy, sys, time

spawn = importlib.import_module("torch.multiprocessing.spawn")
hold = spawn.ProcessContext.__init__

def stalled(self, *args, **kwargs):
    time.sleep(600)
    hold(self, *args, **kwargs)

spawn.ProcessContext.__init__ = stalled
sys.argv = ["app", *sys.argv[4:]]  # what followed `python -m app`
runpy.run_module("app", run_name="__main__", alter_sys=True)
"""


@pytest.mark.e2e
def test_sigterm_while_the_agent_starts_the_ranks_still_stops_them_with_a_checkpoint(
    start_app: Callable[..., AppProcess], tmp_path: Path
) -> None:
    wrapper = tmp_path / "stalled_agent.py"
    wrapper.write_text(STALLED_AGENT)
    app = start_app("stalled", "layout=1t1r", *PPO_FOREVER, "loop.checkpoint_every_s=1e6",
                    prefix=(sys.executable, str(wrapper)))
    app.wait_until("an update", lambda: bool(rows_so_far(app.run_dir)))
    os.kill(app.pid, signal.SIGTERM)
    assert app.wait() == 128 + signal.SIGTERM, app.describe()
    assert app.last_line == (
        f"error: interrupted by SIGTERM: stopped all 2 ranks (logs: {app.run_dir / 'logs'})")
    # The ranks were asked, as the agent asks them: they stopped at an update, with a checkpoint.
    assert "stopped: asked by SIGTERM" in app.log(0), app.describe()
    assert list((app.run_dir / "checkpoints").glob("ckpt_*.pt")), app.describe()
    app.assert_all_ended()


# ---- 6. ports and exposure ------------------------------------------------------------------

LINGER_LOOP = '''
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlcomm import collectives


@dataclass
class Linger:
    """Use every group once, then wait (bounded) until the test has looked at the sockets."""

    release: str = ""
    max_wait_s: float = 180.0

    def __call__(self, ctx, job):
        for mode in sorted(ctx.describe()):
            collectives.all_reduce(ctx, mode, torch.ones(1))
        (job.run_dir / f"up{job.rank}").touch()
        deadline = time.monotonic() + self.max_wait_s
        while not Path(self.release).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        collectives.all_reduce(ctx, "GLOBAL", torch.ones(1))
        return {"released": Path(self.release).exists()}
'''


def _routable_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family.name == "AF_INET" and not addr.address.startswith("127."):
                return str(addr.address)
    return None


def _hostname_prefix() -> tuple[str, ...]:
    """Run the app where the hostname resolves to a routable address, as on a cluster node (gloo
    binds to the hostname's address unless told otherwise): a private UTS namespace whose hostname
    is this machine's non-loopback IP. Empty where that is not allowed (not root, no unshare)."""
    address, unshare = _routable_address(), shutil.which("unshare")
    if address is None or unshare is None:
        return ()
    prefix = (unshare, "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', address)
    probe = subprocess.run([*prefix, "hostname"], capture_output=True, text=True, check=False)
    return prefix if probe.returncode == 0 and probe.stdout.strip() == address else ()


@pytest.mark.e2e
def test_two_runs_at_once_succeed_and_listen_on_loopback_only(
    start_app: Callable[..., AppProcess], tmp_path: Path
) -> None:
    env = user_package(tmp_path, LINGER_LOOP)
    release = tmp_path / "release"
    prefix = _hostname_prefix()
    apps = [start_app(f"run{i}", "layout=1t1r", "loop=custom", "loop._target_=mypkg.loops.Linger",
                      f"+loop.release={release}", env=env, prefix=prefix) for i in range(2)]
    try:
        for app in apps:
            app.wait_until("both ranks in the loop",
                           lambda app=app: all((app.run_dir / f"up{r}").exists() for r in (0, 1)))
        for app in apps:
            listening: dict[int, list[str]] = {}
            for proc in app.processes():
                try:
                    conns = proc.net_connections(kind="inet")
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    continue
                listening[proc.pid] = [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
            ranks = app.ranks()
            assert sorted(ranks) == [0, 1], ranks
            assert listening[app.pid], "the launcher's rendezvous store is not listening"
            assert all(listening[p.pid] for p in ranks.values()), listening  # gloo's sockets
            exposed = {pid: ips for pid, ips in listening.items()
                       if any(ip != "127.0.0.1" for ip in ips)}
            assert not exposed, f"{app.name} listens beyond loopback: {exposed} (prefix {prefix})"
    finally:
        release.touch()
    for app in apps:
        assert app.wait() == 0, app.describe()
        assert [r["result"] for r in read_result(app.run_dir)["ranks"]] == [{"released": True}] * 2
        app.assert_all_ended()
