"""``python -m app`` run as a user runs it, timed to its exit, with what it recorded.

The process's output goes to files, not pipes, so that its exit is timed by ``waitpid`` alone
(reading pipes to their end also waits for whatever else holds them). The run's own timestamps
come from its ``result.json`` (``timeline`` and ``phases``, app/output/timeline.py): the
benchmark adds only the exit, which the app cannot record.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core import Settings
from .procs import REPO_ROOT, users_environment

# The phases of app/output/timeline.py, as the rows name them.
STARTUP_PHASES = {
    "compose_validate_s": "compose + validate",
    "spawn_import_s": "spawn + import",
    "rendezvous_groups_s": "rendezvous + groups",
    "first_update_s": "first update",
}


@dataclass
class AppRun:
    """One finished (or stopped) run of the app."""

    argv: list[str]
    returncode: int | None
    started_at: float  # time.time() just before the process was started
    exited_at: float  # time.time() when waitpid returned
    result: dict[str, Any] | None = None  # result.json, when there is one
    stderr_tail: str = ""
    problem: str = ""  # why the run has no result ("" when it has one)

    @property
    def wall_s(self) -> float:
        """Launch to exit."""
        return self.exited_at - self.started_at

    @property
    def timeline(self) -> dict[str, Any]:
        return dict((self.result or {}).get("timeline") or {})

    @property
    def phases(self) -> dict[str, float | None]:
        return dict((self.result or {}).get("phases") or {})

    def result_to_exit_s(self) -> float | None:
        """``result.json`` written (rank 0's mark) to the process's exit."""
        written = self.timeline.get("result")
        return self.exited_at - written if written is not None else None

    def stop_to_exit_s(self) -> float | None:
        """The stop decision (the first rank's) to the process's exit."""
        stops = [r["stop"] for r in (self.timeline.get("ranks") or {}).values() if "stop" in r]
        return self.exited_at - min(stops) if stops else None

    def launch_to(self, mark: str) -> float | None:
        """Launch to the latest rank's ``mark`` (e.g. ``first_update``)."""
        found = [r[mark] for r in (self.timeline.get("ranks") or {}).values() if mark in r]
        return max(found) - self.started_at if found else None


@dataclass
class Outcome:
    """Samples of one kind of run, and why some are missing."""

    runs: list[AppRun] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def finished(self) -> list[AppRun]:
        return [run for run in self.runs if run.result is not None]


def run_app(overrides: Sequence[str], run_dir: Path, timeout_s: float) -> AppRun:
    """``python -m app OVERRIDES hydra.run.dir=RUN_DIR`` in a fresh session, to its end (or
    killed with everything it started after ``timeout_s``)."""
    argv = [sys.executable, "-m", "app", *overrides, f"hydra.run.dir={run_dir}"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    out, err = run_dir.with_name(f"{run_dir.name}.stdout"), run_dir.with_name(f"{run_dir.name}.stderr")
    with out.open("w") as stdout, err.open("w") as stderr:
        started = time.time()
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=users_environment(),
                                stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout_s)
            exited = time.time()
        except subprocess.TimeoutExpired:
            exited = time.time()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    tail = " / ".join(line for line in err.read_text(errors="replace").splitlines()[-3:] if line)
    run = AppRun(argv, code, started, exited, stderr_tail=tail)
    result = run_dir / "result.json"
    if code is None:
        run.problem = f"did not finish within {timeout_s:.0f} s"
    elif code != 0 or not result.exists():
        run.problem = f"exit code {code}: {tail}"[:600]
    else:
        run.result = json.loads(result.read_text())
    return run


@dataclass
class TimedToTarget:
    """A run of another program, timed from launch to the moment the mean of its last
    ``window`` printed episodic returns reached the target (then it was stopped)."""

    seconds: float | None
    episodes: int
    problem: str = ""


EPISODIC_RETURN = re.compile(r"episodic_return=\[?(-?[\d.]+)")


def run_to_target(argv: Sequence[str], cwd: Path, target: float, window: int, timeout_s: float,
                  ) -> TimedToTarget:
    """Runs ``argv`` and reads its output for ``episodic_return=R`` lines (CleanRL's format);
    stops it, with everything it started, once the mean of the last ``window`` returns is at
    least ``target``: the seconds from launch to then."""
    started = time.time()
    proc = subprocess.Popen(list(argv), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env=users_environment())

    def stop() -> None:
        with contextlib.suppress(ProcessLookupError):  # the process group may be gone already
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, stop)  # a program that falls silent is stopped too
    timer.start()
    returns: list[float] = []
    last: list[str] = []
    reached: float | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            last = [*last[-4:], line.strip()]
            found = EPISODIC_RETURN.search(line)
            if found:
                returns.append(float(found.group(1)))
                recent = returns[-window:]
                if len(recent) == window and sum(recent) / window >= target:
                    reached = time.time() - started
                    break
    finally:
        timer.cancel()
        stop()
        proc.wait()
    if reached is not None:
        return TimedToTarget(reached, len(returns))
    if not returns:
        why = ("it printed no episodic returns (CleanRL's ppo.py reads gymnasium 0.29's "
               "final_info: run it with its own requirements, --cleanrl-python)")
    elif time.time() - started > timeout_s:
        why = f"the mean of the last {window} returns did not reach {target:g} within {timeout_s:.0f} s"
    else:
        why = f"it ended before reaching {target:g} (exit code {proc.returncode})"
    return TimedToTarget(None, len(returns), f"{why}; last output: {' / '.join(last)}"[:600])



# Short default runs (the default layout and loop, 4 updates, then the budget ends the run): the
# start-up and wind-down of a real PPO run (checkpoints, learning curve), with little training.
# startup and wind_down share them within one benchmark run.
SHORT_RUN = ("loop.total_env_steps=8192",)
SHORT_RUN_TIMEOUT_S = 180.0
_short_runs: list[AppRun] = []


def short_runs(settings: Settings, wanted: int) -> tuple[list[AppRun], str]:
    """At least ``wanted`` short default runs (fewer when the time budget ends first: the
    note says so), reusing those made earlier in this benchmark run."""
    while len(_short_runs) < wanted:
        left = settings.seconds_left()
        if left < 30:
            return list(_short_runs), (f"only {len(_short_runs)} of {wanted} runs: the time "
                                       "budget ran out")
        index = len(_short_runs)
        _short_runs.append(run_app(SHORT_RUN, settings.out_dir / "short" / f"run{index}",
                                   min(SHORT_RUN_TIMEOUT_S, left)))
    return list(_short_runs), ""
