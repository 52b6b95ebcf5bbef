"""Time to answer: ranks forked from a preloaded forkserver, the slow outputs off the
critical path, and a finished run that always exits, with real processes.

- Ranks are forked from the launcher's forkserver, which imported torch and the app once: they
  keep their log files, the launcher's environment as it was at launch, and their lifeline (a
  SIGKILLed launcher takes the forkserver and every rank along).
- The layout picture and the learning curve are drawn off the critical path, by the launcher's
  picture service (no rank imports matplotlib), yet exist when the run reports success
  (result.json, the closing summary).
- A rank that finished but does not exit is named in the log and ended: by itself within
  ``launcher.shutdown_timeout``, or, stuck with the interpreter lock held, by the launcher; the
  run still succeeds.
- The run records when it reached each step (result.json's ``timeline`` and ``phases``).

The pieces in this process (the phases, the forkserver's command lines, background work, the
picture service) are tests/unit/test_startup.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.apprun import HANG_S, AppProcess, read_result, running
from tests.helpers.userpkg import user_package

GONE_S = 20.0  # every process is gone this soon after the launcher was SIGKILLed
# A short PPO run: 1 rollout rank x 4 envs x 64 steps per update, 4 updates, then the budget.
PPO_SHORT = ("layout=1t1r", "loop.hparams={num_envs:4,num_steps:64}", "loop.progress=false",
             "loop.total_env_steps=1024")


@pytest.fixture
def start_app(tmp_path: Path) -> Iterator[Callable[..., AppProcess]]:
    """``start_app(name, *overrides, env=...)``; whatever a test leaves running is killed (and
    reported as a survivor) at teardown."""
    apps: list[AppProcess] = []

    def start(name: str, *overrides: str, env: dict[str, str] | None = None) -> AppProcess:
        app = AppProcess(name, tmp_path, overrides, tmp_path / name, env or {}, ())
        apps.append(app)
        return app

    yield start
    for app in apps:
        app.close()


# ---- ranks from the preloaded forkserver --------------------------------------------------------

PROBE_LOOP = '''
import json, os, sys, time
from dataclasses import dataclass
from pathlib import Path

import torch

import app.launch.forkserver
from app.output import pictures
from rlcomm import collectives


@dataclass
class Probe:
    """Says how this rank was started, then waits (bounded) for the test."""

    max_wait_s: float = 120.0

    def __call__(self, ctx, job):
        collectives.all_reduce(ctx, "GLOBAL", torch.ones(1))
        probe = job.run_dir / f"probe{job.rank}.json"
        probe.with_suffix(".tmp").write_text(json.dumps({
            "pid": os.getpid(),
            "forked_by_forkserver": app.launch.forkserver._server_env is not None,
            # What DDP's constructor imports, loaded before this rank existed.
            "dynamo_preloaded": "torch._dynamo" in sys.modules,
            # Pictures are the launcher's: no rank pays for matplotlib.
            "matplotlib_loaded": "matplotlib" in sys.modules,
            "drawn_by": pictures.draw(os.getpid) if job.rank == 0 else None,
            "rank_variable": os.environ.get("RANK"),
            # Set by the launcher after its forkserver had started: only the launcher's
            # environment at launch has them.
            "job_start": os.environ.get("RLCOMM_JOB_START"),
            "timeline": os.environ.get("RLCOMM_TIMELINE"),
        }))
        probe.with_suffix(".tmp").replace(probe)  # whole, for the test that reads it
        deadline = time.monotonic() + self.max_wait_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return {}
'''


@pytest.mark.e2e
def test_ranks_from_the_preloaded_forkserver_keep_their_logs_environment_and_lifeline(
    start_app: Callable[..., AppProcess], tmp_path: Path
) -> None:
    env = user_package(tmp_path, PROBE_LOOP)
    app = start_app("probe", "layout=1t1r", "loop=custom", "loop._target_=mypkg.loops.Probe",
                    env=env)
    app.wait_until("both ranks probed",
                   lambda: all((app.run_dir / f"probe{r}.json").exists() for r in (0, 1)))
    probes = {r: json.loads((app.run_dir / f"probe{r}.json").read_text()) for r in (0, 1)}
    for rank, probe in probes.items():
        assert probe["forked_by_forkserver"], probes
        assert probe["dynamo_preloaded"], probes
        assert not probe["matplotlib_loaded"], probes
        assert probe["rank_variable"] == str(rank), probes  # the agent's own variables kept
        assert probe["job_start"] and probe["timeline"], probes  # the launcher's at launch
        assert "groups:" in app.log(rank), app.describe()  # each rank its own log file
    # The launcher -> its forkserver -> the ranks; the forkserver imported everything once.
    servers = [p for p in app.processes()[1:] if p.ppid() == app.pid and p.name() == "rlcomm-forksrv"]
    assert len(servers) == 1, [(p.pid, p.ppid(), p.name()) for p in app.processes()]
    ranks = app.ranks()
    assert sorted(ranks) == [0, 1] and {p.pid for p in ranks.values()} == \
        {probe["pid"] for probe in probes.values()}, app.describe()
    assert all(p.ppid() == servers[0].pid for p in ranks.values()), app.describe()
    assert probes[0]["drawn_by"] == app.pid, probes  # by the launcher's picture service

    started = app.processes()[1:]
    os.kill(app.pid, signal.SIGKILL)
    assert app.wait(30) == -signal.SIGKILL, app.describe()
    deadline = time.monotonic() + GONE_S
    while running(started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(started), [p.pid for p in running(started)]
    app.assert_all_ended()


# ---- the slow outputs, off the critical path, written before success -----------------------------


@pytest.mark.e2e
def test_the_layout_picture_and_learning_curve_exist_when_the_run_reports_success(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("short", *PPO_SHORT)
    result, curve = app.run_dir / "result.json", app.run_dir / "learning_curve.png"
    seen_result = seen_summary = False
    deadline = time.monotonic() + HANG_S
    while app.proc.poll() is None and time.monotonic() < deadline:
        # Rank 0 writes result.json (renamed into place) once its background jobs are done; the
        # launcher prints the summary once the layout picture is drawn too.
        if not seen_result and result.exists():
            seen_result = True
            assert curve.exists() and curve.stat().st_size > 0, "result.json before the curve"
        if not seen_summary and "---- run summary" in app.stdout:
            seen_summary = True
            assert (app.run_dir / "layout.png").exists(), "the summary before the picture"
        time.sleep(0.01)
    assert app.wait() == 0, app.describe()
    assert (app.run_dir / "layout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(app.run_dir.glob(".*.partial")), list(app.run_dir.iterdir())
    summary = read_result(app.run_dir)
    assert str(curve) in summary["summary"]["files"].values(), summary["summary"]
    # When each step was reached, as the run recorded it.
    marks = summary["timeline"]
    assert marks["start"] <= marks["validated"] <= marks["result"], marks
    for rank in ("0", "1"):
        ranked = marks["ranks"][rank]
        assert marks["validated"] <= ranked["started"] <= ranked["groups"] <= ranked["loop"] \
            <= ranked["finished"] <= marks["result"], marks
    phases = summary["phases"]
    for name in ("compose_validate_s", "spawn_import_s", "rendezvous_groups_s"):
        assert phases[name] is not None and phases[name] >= 0, phases
    app.assert_all_ended()


# ---- a finished run always exits ----------------------------------------------------------------

LINGERING_LOOP = '''
import ctypes, multiprocessing.util, threading, time
from dataclasses import dataclass

import torch

from rlcomm import collectives


def _sleeper():
    time.sleep(3600)


def _hold_the_lock():
    ctypes.PyDLL(None).sleep(3600)  # a C call that keeps the interpreter lock


@dataclass
class Linger:
    """Works like any loop; rank 1 then leaves something behind that keeps its process alive."""

    how: str = "thread"

    def __call__(self, ctx, job):
        collectives.all_reduce(ctx, "GLOBAL", torch.ones(1))
        if job.rank == 1:
            if self.how == "thread":  # a thread nobody stops: the interpreter waits for it
                threading.Thread(target=_sleeper, name="sleeper").start()
            else:  # stuck at the very end of the process, holding the interpreter lock
                multiprocessing.util.Finalize(None, _hold_the_lock, exitpriority=100)
        return {"done": True}
'''


def _lingering(start_app: Callable[..., AppProcess], tmp_path: Path, how: str,
               shutdown_timeout: float) -> tuple[AppProcess, float]:
    """A run whose rank 1 lingers ``how``; returns it, ended, and how long after result.json
    its launcher exited."""
    env = user_package(tmp_path, LINGERING_LOOP)
    app = start_app(how, "layout=1t1r", "loop=custom", "loop._target_=mypkg.loops.Linger",
                    f"+loop.how={how}", f"launcher.shutdown_timeout={shutdown_timeout}", env=env)
    app.wait_until("result.json", lambda: (app.run_dir / "result.json").exists())
    written = time.monotonic()
    assert app.wait() == 0, app.describe()
    took = time.monotonic() - written
    assert read_result(app.run_dir)["status"] == "ok"
    assert "---- run summary" in app.stdout, app.describe()
    app.assert_all_ended()
    return app, took


@pytest.mark.e2e
def test_a_finished_rank_that_will_not_exit_is_named_and_ends_itself(
    start_app: Callable[..., AppProcess], tmp_path: Path
) -> None:
    app, took = _lingering(start_app, tmp_path, "thread", shutdown_timeout=2.0)
    named = re.search(r"^\[rank1\] rank 1 finished ([\d.]+) s ago but has not exited "
                      r"\(thread 'sleeper'\); ending it", app.stderr, re.MULTILINE)
    assert named and float(named.group(1)) >= 2.0, app.describe()
    assert "killing it" not in app.stderr, app.describe()  # the rank ended itself, in time
    assert "_sleeper" in app.log(1)  # the stacks of its threads, in its log
    assert took < 2.0 + 30, f"exited {took:.1f} s after result.json"
    print(f"\nexited {took:.2f} s after result.json (shutdown_timeout 2 s)")


@pytest.mark.e2e
def test_a_finished_rank_stuck_holding_the_interpreter_lock_is_named_and_killed(
    start_app: Callable[..., AppProcess], tmp_path: Path
) -> None:
    app, took = _lingering(start_app, tmp_path, "lock", shutdown_timeout=1.0)
    assert re.search(r"^\[launcher\] rank 1 \(pid \d+\) has not exited [\d.]+ s after the run "
                     r"finished \(result\.json\); killing it \(log: .*rank1\.log\)$", app.stderr,
                     re.MULTILINE), app.describe()
    assert took < 2 * 1.0 + 30, f"exited {took:.1f} s after result.json"
    print(f"\nexited {took:.2f} s after result.json (killed after 2 x shutdown_timeout 1 s)")
