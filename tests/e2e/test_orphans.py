"""A killed launcher leaves nothing running, with real processes and signals.

``kill -9`` of the launcher is what the OOM killer or a batch system's hard limit does: no handler
runs. Every rank (tied to its launcher's forkserver, the forkserver to the launcher, by
app/launch/lifeline.py), the forkserver and multiprocessing's resource tracker must end within a
few seconds anyway, also while the ranks are blocked in a collective,
and the run dir must stay resumable from its newest checkpoint. torchrun's agent killed the same
way takes its ranks with it too. A rank whose launcher died before the rank could tie itself to
it is tests/integration/test_lifeline.py.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import psutil
import pytest

from tests.helpers.apprun import AppProcess, read_result, running

GONE_S = 20.0  # every process the launcher started is gone this soon after it was SIGKILLed
# Small PPO steps so an update takes a fraction of a second even on 2 loaded cores; a long comm
# timeout so that only the launcher's death can end the ranks in time (no group timeout, no hang
# diagnosis).
PPO_SMALL = ("loop.hparams={num_envs:4,num_steps:64}", "loop.progress=false",
             "loop.target_return=1e9", "loop.checkpoint_every=1")
PPO_FOREVER = (*PPO_SMALL, f"loop.total_env_steps={10**10}", "comm.timeout=600",
               "comm.hang_timeout=500")
STEPS_PER_UPDATE = 2 * 4 * 64  # layout 2t2r: 2 rollout ranks x num_envs x num_steps
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--no-python")  # the app's command line follows: torchrun's ranks run it as it is


def _has_checkpoint(folder: Path) -> bool:
    return any(folder.glob("ckpt_*.pt"))


def _describe(procs: list[psutil.Process]) -> list[str]:
    described = []
    for proc in procs:
        try:
            described.append(f"{proc.pid} {proc.status()} {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            described.append(f"{proc.pid} (gone)")
    return described


def _sigkill_launcher(app: AppProcess) -> float:
    """SIGKILL the launcher and wait until every process under it has ended; returns how long
    that took (reported, not asserted beyond GONE_S)."""
    started = app.processes()[1:]
    assert started, app.describe()
    os.kill(app.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert app.wait(30) == -signal.SIGKILL, app.describe()
    while (left := running(started)) and time.monotonic() - killed_at < GONE_S:
        time.sleep(0.05)
    took = time.monotonic() - killed_at
    assert not left, f"still running {took:.1f}s after the launcher was SIGKILLed: " \
                     f"{_describe(left)}\n{app.describe()}"
    return took


@pytest.mark.e2e
def test_a_sigkilled_launcher_takes_every_rank_and_the_resource_tracker_with_it(
    start_app: Callable[..., AppProcess],
) -> None:
    # Three kills (the bug showed in one of three): at whatever point training is, and once with
    # a rank frozen (SIGSTOP), so that its peers are blocked in a collective waiting for it when
    # the launcher dies, as in the bug, and the frozen rank itself could act on no handler.
    took = []
    for attempt, freeze in enumerate((False, True, False)):
        app = start_app(f"killed{attempt}", *PPO_FOREVER)
        checkpoints = app.run_dir / "checkpoints"
        app.wait_until_training()
        app.wait_until("a first checkpoint", partial(_has_checkpoint, checkpoints))
        ranks = app.ranks()
        assert sorted(ranks) == [0, 1, 2, 3], (ranks, app.describe())
        # The elastic agent runs inside the launcher and has the launcher's forkserver fork
        # every rank (app/launch/forkserver.py): the ranks are the forkserver's children, the
        # forkserver and the resource tracker the launcher's.
        servers = [p for p in app.processes()[1:] if p.name() == "rlcomm-forksrv"
                   and p.ppid() == app.pid]
        assert len(servers) == 1, _describe(app.processes())
        # An elastic rank (the rollout ranks 2, 3 and trainer 1, not the lead) is the child of
        # its slot, which the forkserver forked (app/launch/slots.py).
        parents = {rank: psutil.Process(proc.ppid()) for rank, proc in ranks.items()}
        assert parents[0].pid == servers[0].pid
        assert {rank: (p.name(), p.ppid()) for rank, p in parents.items() if rank >= 1} == {
            rank: (f"rlcomm-slot{rank}", servers[0].pid) for rank in (1, 2, 3)}
        trackers = [p for p in app.processes()[1:] if "resource_tracker" in " ".join(p.cmdline())]
        assert len(trackers) == 1 and trackers[0].ppid() == app.pid, _describe(app.processes())
        if freeze:
            ranks[3].suspend()
            time.sleep(1.0)  # the others run into a collective that rank 3 never joins
        took.append(_sigkill_launcher(app))
        assert not running([*ranks.values(), *trackers, *servers])
        app.assert_all_ended()
    print(f"\nevery process gone {', '.join(f'{s:.2f}' for s in took)} s after the SIGKILL")

    # The last killed run resumes from its newest checkpoint, into a new run dir.
    newest = max(checkpoints.glob("ckpt_*.pt"), key=lambda p: p.name)
    at = int(newest.stem.removeprefix("ckpt_"))
    updates = at + 2
    resumed = start_app("resumed", *PPO_SMALL, f"loop.total_env_steps={updates * STEPS_PER_UPDATE}",
                        f"loop.resume={app.run_dir}")
    assert resumed.wait() == 0, resumed.describe()
    for rank in range(4):
        found = re.findall(r"resumed from (\S+) at update (\d+)", resumed.log(rank))
        assert [(Path(source).name, int(update)) for source, update in found] == \
               [(newest.name, at)], (rank, found, resumed.describe())
    result = read_result(resumed.run_dir)
    assert {(r["rank"], r["result"]["updates"], r["result"]["env_steps"]) for r in result["ranks"]} \
        == {(rank, updates, updates * STEPS_PER_UPDATE) for rank in range(4)}, result["ranks"]
    resumed.assert_all_ended()


@pytest.mark.e2e
def test_a_sigkilled_torchrun_agent_takes_its_ranks_with_it(
    start_app: Callable[..., AppProcess],
) -> None:
    # torchrun starts each rank with a command line in a session of its own: torch gives such a
    # rank no parent-death signal, so before the lifeline it trained on without its agent.
    app = start_app("torchrun", "layout=1t1r", *PPO_FOREVER, prefix=TORCHRUN)
    app.wait_until_training(world_size=2)
    ranks = app.ranks()
    assert sorted(ranks) == [0, 1], (ranks, app.describe())
    assert {rank: proc.ppid() for rank, proc in ranks.items()} == dict.fromkeys(ranks, app.pid)
    took = _sigkill_launcher(app)
    print(f"\nevery torchrun rank gone {took:.2f} s after the SIGKILL")
    app.assert_all_ended()


