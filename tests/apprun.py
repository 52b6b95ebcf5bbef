"""Run ``python -m app`` as a user would, and check that no process it started survives."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from app.environment import without_launcher_variables

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
    full_env = {
        **without_launcher_variables(os.environ), MARKER: marker, "PYTHONPATH": str(REPO),
        **(env or {}),
    }
    try:
        return subprocess.run(
            [*module, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )
    finally:
        assert_no_survivors(marker)


def describe(proc: subprocess.CompletedProcess[Any]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
