"""Run ``python -m app`` as a user would, and check that no process it started survives."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from app.launch.environment import without_launcher_variables

REPO = Path(__file__).resolve().parent.parent
MARKER = "RLCOMM_TEST_MARKER"


def processes_with_marker(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def assert_no_survivors(marker: str, grace_s: float = 10.0) -> None:
    deadline = time.monotonic() + grace_s
    while (alive := processes_with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in alive:
        proc.kill()
    assert not alive, f"processes left behind: {[p.cmdline() for p in alive]}"


def run_app(
    *args: str,
    cwd: Path = REPO,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    module: tuple[str, ...] = (sys.executable, "-m", "app"),
) -> subprocess.CompletedProcess[str]:
    marker = uuid.uuid4().hex
    try:
        return subprocess.run(
            [*module, *args], cwd=cwd, env=app_env(marker, env), capture_output=True, text=True,
            timeout=timeout, check=False,
        )
    finally:
        assert_no_survivors(marker)


def app_env(marker: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an app run by a test: this checkout's code, no launcher variables,
    and a marker that finds every process the run started."""
    return {
        **without_launcher_variables(os.environ), MARKER: marker, "PYTHONPATH": str(REPO),
        **(env or {}),
    }


def run_app_in_terminal(
    *args: str, columns: int = 140, rows: int = 40, cwd: Path = REPO, timeout: float = 300
) -> tuple[int, bytes]:
    """``python -m app`` on a pseudo-terminal of ``columns`` x ``rows``, as a person runs it;
    returns the exit code and every byte written to the terminal."""
    marker = uuid.uuid4().hex
    env = app_env(marker)
    for name in ("COLUMNS", "LINES"):  # the size comes from the terminal itself
        env.pop(name, None)
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    output = bytearray()
    try:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "app", *args], cwd=cwd, env=env, stdin=secondary,
                stdout=secondary, stderr=secondary, start_new_session=True,
            )
        finally:
            os.close(secondary)  # only the app holds the terminal now: EOF when it is done
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not chunk:
                break
            output += chunk
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        return code, bytes(output)
    finally:
        os.close(primary)
        assert_no_survivors(marker)


def describe(proc: subprocess.CompletedProcess[Any]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
