"""Run ``python -m app`` as a user would (to the end, on a terminal, or in the background with
:class:`AppProcess`), check that no process it started survives, and read what it left."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from app.launch.environment import without_launcher_variables
from app.runtime.checkpoints.checkpoint import is_checkpoint, update_of

REPO = Path(__file__).resolve().parents[2]
MARKER = "RLCOMM_TEST_MARKER"
# Every layout conf/layout/ ships, by name.
LAYOUTS = sorted(p.stem for p in (REPO / "conf" / "layout").glob("*.yaml"))
HANG_S = 240.0  # a run still going after this is a hang: the test fails instead of blocking


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running (a zombie has ended: only its exit status is left)."""
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return alive


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


def read_result(run_dir: Path) -> dict[str, Any]:
    """The run's ``result.json``."""
    result: dict[str, Any] = json.loads((run_dir / "result.json").read_text())
    return result


def metrics(run_dir: Path) -> list[dict[str, float]]:
    """The run's ``metrics.csv``, one dict of floats per row."""
    with (run_dir / "metrics.csv").open() as handle:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def rows_so_far(run_dir: Path) -> list[dict[str, str]]:
    """``metrics.csv`` as far as a run in progress has written it ([] before its first row)."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open() as handle:
        return list(csv.DictReader(handle))


def checkpointed(root: Path, update: int) -> bool:
    """Whether a checkpoint of ``update`` or later is under ``root`` (a run's checkpoints, or a
    folder above). A poll must not wait for one update's file: retention removes it once newer
    ones are written (``loop.checkpoint_keep``), within a poll's sleep on a fast machine."""
    with contextlib.suppress(OSError):  # a checkpoint retired while the folder is read
        return any(update_of(p) >= update for p in root.rglob("ckpt_*") if is_checkpoint(p))
    return False


def column(run_dir: Path, name: str) -> list[int]:
    """One column of ``metrics.csv`` so far, as ints (``update``, ``trainers``)."""
    return [int(float(row[name])) for row in rows_so_far(run_dir)]


def collapse(values: list[int]) -> list[int]:
    """Runs of equal values as one: [2, 2, 1, 1, 2] -> [2, 1, 2]."""
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


def run_ppo(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """A PPO run (no progress bar) in ``run_dir`` that must succeed; its ``result.json``."""
    proc = run_app("loop.progress=false", f"hydra.run.dir={run_dir}", *overrides)
    assert proc.returncode == 0, describe(proc)
    return read_result(run_dir)


def assert_commcheck_passed(result: dict[str, Any], world_size: int) -> None:
    assert result["status"] == "ok" and result["world_size"] == world_size
    assert sorted(r["rank"] for r in result["ranks"]) == list(range(world_size))
    for report in result["ranks"]:
        checked = {k: v for k, v in report["result"].items() if k not in ("metrics", "slowest_group")}
        assert set(checked) == set(report["groups"])  # every group was checked
        assert all(g["checks"] == "passed" for g in checked.values())


class AppProcess:
    """``python -m app`` started as a user would, in its own session, output in files."""

    def __init__(self, name: str, workdir: Path, overrides: tuple[str, ...], run_dir: Path,
                 env: dict[str, str], prefix: tuple[str, ...]) -> None:
        self.name, self.run_dir = name, run_dir
        self.marker = uuid.uuid4().hex
        self._stdout_path = workdir / f"{name}.stdout"
        self._stderr_path = workdir / f"{name}.stderr"
        full_env = without_launcher_variables(os.environ)
        full_env.update({MARKER: self.marker, "PYTHONPATH": str(REPO), **env})
        with self._stdout_path.open("w") as out, self._stderr_path.open("w") as err:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "app", *overrides, f"hydra.run.dir={run_dir}"],
                cwd=workdir, env=full_env, stdout=out, stderr=err, start_new_session=True,
            )
        self.pid = self.proc.pid
        self.started = time.monotonic()

    @property
    def stderr(self) -> str:
        return self._stderr_path.read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return self._stdout_path.read_text(errors="replace")

    @property
    def last_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""

    def log_path(self, rank: int) -> Path:
        return self.run_dir / "logs" / f"rank{rank}.log"

    def log(self, rank: int) -> str:
        path = self.log_path(rank)
        return path.read_text(errors="replace") if path.exists() else ""

    def describe(self) -> str:
        return (f"{self.name}: exit {self.proc.poll()}\n--- stdout\n"
                f"{self.stdout[-3000:]}\n--- stderr\n"
                f"{self.stderr[-5000:]}")

    def wait_until(self, what: str, condition: Callable[[], bool], timeout: float = HANG_S) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                if condition():  # it came true as the app ended
                    return
                raise AssertionError(f"the app ended before {what}\n{self.describe()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} after {timeout:.0f}s\n{self.describe()}")
            time.sleep(0.05)

    def wait_until_training(self, world_size: int = 4) -> None:
        """Every rank created its groups (the loop is running)."""
        self.wait_until("ranks with groups",
                        lambda: all("groups:" in self.log(r) for r in range(world_size)))

    def wait(self, timeout: float = HANG_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:.0f}s\n{self.describe()}") from None

    def processes(self) -> list[psutil.Process]:
        """The launcher and everything under it."""
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def ranks(self) -> dict[int, psutil.Process]:
        """Rank processes by rank, told apart by the rank log file each one holds open (the
        agent sets RANK after the process starts, so /proc/<pid>/environ does not show it). An
        elastic rollout rank's slot (app/launch/slots.py) holds it too: the rank is its child,
        the process named ``rlcomm-rank<N>``."""
        found: dict[int, psutil.Process] = {}
        for proc in self.processes()[1:]:
            try:
                for f in proc.open_files():
                    match = re.fullmatch(r"rank(\d+)\.log", Path(f.path).name)
                    if match and Path(f.path).parent == self.run_dir / "logs":
                        rank = int(match.group(1))
                        if rank not in found or proc.name().startswith("rlcomm-rank"):
                            found[rank] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def assert_all_ended(self) -> None:
        """The launcher was reaped, and no process it started is still around anywhere."""
        assert self.proc.poll() is not None, f"{self.name} is still running"
        assert not psutil.pid_exists(self.pid) or psutil.Process(self.pid).ppid() != os.getpid()
        assert_no_survivors(self.marker)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait(30)
        assert_no_survivors(self.marker)


def start_by_hand(
    tmp_path: Path, marker: str, *app_args: str, layout: str = "1t1r", world_size: int = 2,
) -> tuple[Path, Callable[[int, str], subprocess.Popen[str]]]:
    """Ranks of ``layout`` started one by one (the env join mode, as srun or a hand-made
    script would): the run dir they agree on, and ``start(rank, name)``, which starts one with
    its output in ``<name>.out``."""
    from rlcomm.testing import free_port

    base = {"WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "RLCOMM_RUN_ID": f"byhand-{marker[:8]}"}
    args = [sys.executable, "-m", "app", f"layout={layout}", "loop.target_return=1e9",
            "loop.progress=false", *app_args]

    def start(rank: int, name: str) -> subprocess.Popen[str]:
        out = (tmp_path / f"{name}.out").open("w")
        return subprocess.Popen(args, cwd=tmp_path, text=True, stdout=out,
                                stderr=subprocess.STDOUT,
                                env=app_env(marker, {**base, "RANK": str(rank)}))

    return tmp_path / "outputs" / "runs" / base["RLCOMM_RUN_ID"], start


def end_all(procs: list[subprocess.Popen[str]], marker: str) -> None:
    """Kills what is still running and checks nothing of the run survives."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert_no_survivors(marker)
