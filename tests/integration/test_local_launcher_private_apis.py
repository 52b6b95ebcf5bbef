"""The private APIs of the local launcher's processes that only real processes show, pinned
(the rest, in-process, and the list of all of them: tests/unit/test_private_apis.py): the
elastic agent's rank processes as multiprocessing's Process objects of the launcher
(``multiprocessing.process._children``, how app/launch/failures.py: DeathWatch watches its
ranks), the forkserver's preload (app/launch/forkserver.py), the exit handlers ``python -m app``
runs before it ends (``atexit._run_exitfuncs``), and gloo's wording of a peer that left or fell
silent, which the code matches on (rlcomm/net/gloo_words.py, its one reader).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from app.launch import private
from app.launch.failures import classify
from rlcomm.net.gloo_words import (
    PEER_CLOSED,
    TIMED_OUT,
    describe_loss,
    gist,
    peer_addresses,
    says_peer_closed_or_timed_out,
    says_peer_lost,
)
from rlcomm.testing import run_ranks

pytestmark = pytest.mark.integration


def _rank_until_told(folder: str) -> None:
    """An agent's rank: says it runs, then waits (bounded) until the test has looked at it."""
    (Path(folder) / f"started.{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while not (Path(folder) / "stop").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_elastic_agents_forkserver_ranks_are_the_launchers_process_objects(
    tmp_path: Path,
) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    # How the agent LocalElasticAgent (start_method="forkserver", app/launch/local.py) starts
    # ranks: DeathWatch (app/launch/failures.py) finds them among multiprocessing's Process
    # objects of this process.
    ranks = start_processes(
        name="pin", entrypoint=_rank_until_told, args={0: (str(tmp_path),), 1: (str(tmp_path),)},
        envs={0: {}, 1: {}}, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
        start_method="forkserver",
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("started.*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = sorted(int(p.suffix[1:]) for p in tmp_path.glob("started.*"))
        spawned = sorted(ranks.pids().values())
        assert started == spawned, (started, spawned)
        children = private.started_processes()
        found = sorted(p.pid for p in children if p.pid in spawned and p.sentinel >= 0)
    finally:
        (tmp_path / "stop").touch()
        ranks.wait(timeout=60)
        ranks.close()
    if found != spawned:
        pytest.fail(f"private API changed: multiprocessing.process._children (used in "
                    f"app/launch/private.py: started_processes, for DeathWatch) holds {found}, "
                    f"ranks {spawned}")


_PRELOADED = """
    import multiprocessing, os, sys
    from multiprocessing import forkserver
    import app.launch.forkserver as ours

    def report():
        return ours._server_env is not None, os.getppid(), ours.running()

    if __name__ == "__main__":
        ours.start("picture")
        ctx = multiprocessing.get_context("forkserver")
        with ctx.Pool(1) as pool:
            preloaded, parent, _ = pool.apply(report)
        # Forked by a forkserver that imported app.launch.forkserver within its preload and
        # tied itself to this process: the forkserver is this process's child.
        server = [int(line.split()[0]) for line in os.popen(f"ps -o pid= --ppid {os.getpid()}")]
        print(preloaded, parent in server)
        import atexit
        atexit.register(lambda: print("exit handler ran", flush=True))
        atexit._run_exitfuncs()
        sys.stdout.flush()
        os._exit(0)
"""


def test_the_forkserver_preloads_this_app_and_exit_handlers_run_on_request(tmp_path: Path) -> None:
    script = tmp_path / "preloaded.py"
    script.write_text(textwrap.dedent(_PRELOADED))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr
    if done.stdout.splitlines() != ["True True", "exit handler ran"]:
        pytest.fail("private API changed: multiprocessing.forkserver.main's preload (used in "
                    "app/launch/private.py: in_forkserver_preload) or atexit._run_exitfuncs "
                    f"(app/__main__.py: _exit): {done.stdout!r} {done.stderr[-2000:]}")


def _running(pid: int | None) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _lose_the_peer(rank: int, world_size: int, when: str) -> str | None:
    """Rank 1 leaves without a word (its process ends, its sockets close) while rank 0 is in
    (``during``) or enters (``after``) an all_reduce with it; rank 0 returns gloo's error."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    pids: list[int | None] = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        return None
    deadline = time.monotonic() + 60
    while when == "after" and _running(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.05)  # until rank 1's process has ended
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as err:
        return str(err)
    return "no error"


def _fall_silent(rank: int, world_size: int) -> str | None:
    """Rank 1 stays away from a collective longer than its group's timeout."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(6)
        return None
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("when", ["during", "after"])
def test_gloos_words_for_a_lost_peer_are_the_ones_the_code_matches(when: str) -> None:
    said = run_ranks(_lose_the_peer, 2, when, timeout=120)[0]
    assert said is not None
    where = "rlcomm/net/gloo_words.py: PEER_CLOSED, PEER_ADDRESS, gist"
    problems = []
    if not says_peer_lost(said) or classify(RuntimeError(said)) != "peer_lost":
        problems.append(f"none of PEER_CLOSED {PEER_CLOSED} (a peer_lost failure)")
    if (not any(w in said for w in PEER_CLOSED) or not says_peer_closed_or_timed_out(said)
            or describe_loss(RuntimeError(said)) != "connection closed"):
        problems.append("a closed connection, as hosts and elastic members read it")
    if peer_addresses(said) != ["127.0.0.1"]:
        problems.append("the peer's address as [127.0.0.1]:port")
    said_gist = gist(RuntimeError(said))
    if said_gist.startswith("[") or not any(w in said_gist for w in PEER_CLOSED):
        problems.append(f"a source location prefix that gist strips (it made {said_gist!r})")
    if problems:
        pytest.fail(f"private API changed: gloo's words for a lost peer (used in {where}): "
                    f"{said!r} has not {'; nor '.join(problems)}")


def test_gloos_words_for_a_silent_peer_are_the_ones_the_code_matches() -> None:
    said = run_ranks(_fall_silent, 2, timeout=120)[0]
    assert said is not None
    said_gist = gist(RuntimeError(said))
    if (not says_peer_closed_or_timed_out(said) or not said_gist.startswith("Timed out")
            or describe_loss(RuntimeError(said)) != "timed out"):
        pytest.fail(f"private API changed: gloo's words for a peer that timed out (used in "
                    f"rlcomm/net/gloo_words.py: TIMED_OUT, gist): {said!r} (gist "
                    f"{said_gist!r}) does not say {' or '.join(TIMED_OUT)} after a location prefix")
