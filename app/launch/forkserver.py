"""The ranks' forkserver: one process that imports torch, gymnasium, Hydra and the app once,
from which every local rank is forked (torch elastic's ``start_method="forkserver"``).

Spawned ranks each imported all of that again: 4 ranks on 2 cores paid for it 4 times after the
launcher had paid once. ``python -m app`` imports torch (the launcher needs it for the loops'
schemas) and then starts the forkserver (:func:`start_early`) as a fork of itself
(app/launch/private.py: ``fork_forkserver``), so that torch is imported once, not in the
launcher and again in a new interpreter; the forkserver's other imports run beside the
launcher's (Hydra composing, validating) on another core, and once the plan is validated a
rank costs a fork. The forkserver does that work while it imports its preload,
app/launch/forkserver_preload.py (:func:`serve_if_forkserver`): the one hook multiprocessing
gives a forkserver. A forkserver started later (it died, or a submitit job starts one) is a new
interpreter, as multiprocessing starts it: by then the process holds threads and has run torch.

What a spawned rank had, a forked one keeps:

- the launcher's environment as it is at launch, not as it was when the forkserver started:
  the launcher passes it along and the rank adopts it (:func:`adopt_launcher_environment`);
  the working directory, ``sys.path`` and ``sys.argv`` come with multiprocessing's own
  preparation data;
- its lifeline (app/launch/lifeline.py): the forkserver asks for SIGKILL when the launcher
  dies, and each rank when the forkserver does, so a SIGKILLed launcher takes both along;
- signals: the forkserver ignores SIGINT (multiprocessing's choice), its children get the
  launcher's dispositions back; a rank is in the launcher's process group as before, so Ctrl-C
  reaches every rank.

The layout picture of ``plan_only=true`` is drawn in a side job (:class:`SideJob`) forked from
a forkserver that preloads only what pictures need (the ``picture`` profile). A local run's
pictures are drawn by its launcher (app/output/pictures.py), and the ranks' forkserver leaves
matplotlib out.

A forked rank ends with ``os._exit`` once its function returned (multiprocessing's forkserver
children do not tear the interpreter down): a finished rank exits in milliseconds, not in the
second an interpreter holding torch takes to finalise.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from app.launch.private import fork_forkserver
from app.output.pictures import MODULES as PICTURE_MODULES

START_METHOD = "forkserver"
# What the forkserver imports before it forks anything: the one hook multiprocessing offers.
PRELOAD = "app.launch.forkserver_preload"
# "<launcher pid>:<profile>", in the launcher's environment: the forkserver it starts preloads
# the profile's modules and ties itself to that pid.
MARKER = "RLCOMM_FORKSERVER"

# What a rank imports, in the order it does (app/launch/local.py -> rank.py -> the loop).
RANK_MODULES = (
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing",
    "torch.nn.parallel",
    # DDP's constructor imports it, and the import is slow: once here, beside the launcher's own
    # imports, not in every trainer between its start and its first update.
    "torch._dynamo",
    "omegaconf",
    "hydra.utils",
    "gymnasium",
    "tqdm",
    "rlcomm.context",
    "rlcomm.collectives",
    "app.launch.local",
    "app.launch.rank",
    "app.runtime.run",
    "app.loops",  # then every loop package under it: see _preload
)
# Without matplotlib: half a second sooner to the first fork.
PROFILES = {"ranks": RANK_MODULES, "picture": PICTURE_MODULES}

# Command-line flags of Hydra's that start no rank (help, config printing, completion).
_NOT_LAUNCHING = frozenset({
    "--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc",
    "--version", "--resolve", "--package", "-p",
})
_PR_SET_NAME = 15  # <linux/prctl.h>

_started = False  # in the launcher: its forkserver runs
_server_env: dict[str, str] | None = None  # in the forkserver and its children: its environment


def start_early(argv: Sequence[str] | None = None) -> str | None:
    """Starts the forkserver where ``python -m app`` (or ``rlcomm-run``) will start ranks or draw
    a layout (:func:`early_profile`); returns the profile started, or None. A forkserver that
    turns out unneeded (the config set ``plan_only`` after all) only cost CPU: it ends with the
    launcher."""
    if not (sys.platform.startswith("linux") and invoked_as_app()):
        return None
    if multiprocessing.current_process().name != "MainProcess" or multiprocessing.parent_process():
        return None
    from app.launch.environment import launched_by

    profile = early_profile(sys.argv[1:] if argv is None else argv, launched_by() != "local")
    if profile is not None:
        start(profile, fork=True)
    return profile


def early_profile(argv: Sequence[str], joins: bool) -> str | None:
    """Which forkserver a command line wants before its config is composed: ``picture`` for
    ``plan_only=true`` (the layout picture), ``ranks`` for a run, None for ``--help`` and the
    like, for a rank of a joined run (torchrun, SLURM: ``joins``) and under a submitit launcher
    (its jobs start elsewhere)."""
    if joins:
        return None
    if any(a in _NOT_LAUNCHING or a.startswith(("--cfg=", "hydra/launcher=")) for a in argv):
        return None
    return "picture" if _plan_only(argv) else "ranks"


def start(profile: str = "ranks", fork: bool = False) -> bool:
    """Makes sure this launcher's forkserver runs (a no-op when it does); False where there is
    none to be had (not Linux). ``fork``: as a fork of this process, which holds one thread and
    has run no torch op yet (torch's OpenMP threads do not survive a fork); else a new
    interpreter."""
    global _started
    if not sys.platform.startswith("linux"):
        return False
    from multiprocessing import forkserver

    # Kept in the environment: a forkserver that died is started again from it, tied as well.
    os.environ[MARKER] = f"{os.getpid()}:{profile}"
    forkserver.set_forkserver_preload([PRELOAD])
    if fork and not _started and threading.active_count() == 1:
        fork_forkserver([PRELOAD])  # it keeps what this process imported (torch)
    else:  # started again (it died), or by a process that has done more than import
        forkserver.ensure_running()
    _started = True
    return True


def running() -> bool:
    """Whether this process started a forkserver (ranks and side jobs are forked from it)."""
    return _started


def adopt_launcher_environment(launcher_env: Mapping[str, str]) -> None:
    """In a rank the forkserver forked: the launcher's environment at launch, plus what was set
    in this process since the forkserver started (the elastic agent's per-rank variables, what
    the preloaded modules set). A spawned rank has the launcher's environment already."""
    if _server_env is None:
        return
    since = {k: v for k, v in os.environ.items() if _server_env.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(since)


class SideJob:
    """``fn(*args)`` in a process of its own at a low priority (``nice``), forked from the
    forkserver where it runs (nothing left to import), else from this process, which must then
    hold no other thread. The caller :meth:`wait` s for it before it reports success; the job's
    error is raised there. The process is tied to this one (app/launch/lifeline.py)."""

    def __init__(self, name: str, fn: Callable[..., Any], *args: Any, nice: int = 10) -> None:
        ctx: Any = multiprocessing.get_context(START_METHOD if _started else "fork")
        self.name = name
        self._reader, writer = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_side_main, args=(name, fn, args, writer, nice),
                                    name=f"rlcomm-{name}", daemon=True)
        self._process.start()
        writer.close()
        self._outcome: tuple[str, Any] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def wait(self, timeout_s: float | None = None) -> Any:
        """The job's return value, once it is done; its exception is raised here. TimeoutError
        names the job when it is not done within ``timeout_s``."""
        if self._outcome is None:
            if not self._reader.poll(timeout_s):
                raise TimeoutError(f"{self.name}: not done after {timeout_s:g} s")
            try:
                self._outcome = self._reader.recv()
            except (EOFError, OSError):
                self._process.join(5)
                self._outcome = ("error", RuntimeError(
                    f"{self.name}: its process ended without a result "
                    f"(exit code {self._process.exitcode})"))
            self._reader.close()
            self._process.join(5)
        kind, value = self._outcome
        if kind == "error":
            if not isinstance(value, Exception):  # not the waiter's own interrupt or exit
                raise RuntimeError(f"{self.name}: stopped by {type(value).__name__}")
            raise value
        return value

    def cancel(self) -> None:
        """Stops the job if it still runs (the run failed: nobody will wait for it)."""
        if self._process.is_alive():
            self._process.kill()
        self._process.join(5)


def _side_main(name: str, fn: Callable[..., Any], args: tuple[Any, ...], conn: Any,
               nice: int) -> None:
    from app.launch.lifeline import tie_to_launcher

    tie_to_launcher(launched_here=True)
    # Ctrl-C stops the launcher, which then stops this job (or waits for it): not halfway. So does
    # SIGTERM, which a batch system's preemption sends to the whole process group (srun).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(nice)
    set_process_name(f"rlcomm-{name}")
    try:
        outcome: tuple[str, Any] = ("ok", fn(*args))
    except BaseException as err:
        outcome = ("error", err)
    try:
        conn.send(outcome)
    except Exception as err:  # an unpicklable result or error: its text
        conn.send(("error", RuntimeError(f"{name}: {outcome[1]!r} ({err})")))
    conn.close()


def set_process_name(name: str) -> None:
    """This process's name as ``ps`` and ``top`` show it (Linux: 15 characters)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def invoked_as_app() -> bool:
    """``python -m app`` or the ``rlcomm-run`` script: not a test or a tool importing the app."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name == "app.__main__":
        return True
    return os.path.basename(sys.argv[0]) == "rlcomm-run"


def _plan_only(args: Sequence[str]) -> bool:
    for arg in args:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "plan_only":
            return value.strip().lower() in ("true", "yes", "on", "1")
    return False


def _serve(launcher: int, profile: str) -> None:
    """In the forkserver, before it forks anything: tie it to the launcher, then import."""
    global _server_env
    from app.launch.lifeline import die_with_parent

    die_with_parent()
    if os.getppid() != launcher:  # the launcher died before the request
        os._exit(0)
    set_process_name("rlcomm-forksrv")
    _server_env = dict(os.environ)
    _preload(PROFILES.get(profile, ()))


def _preload(names: Sequence[str]) -> None:
    """Imports ``names``; one that fails is left to fail again, with its own error, where a
    rank imports it."""
    import pkgutil

    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        if name == "app.loops":  # every loop shipped with the app
            for found in pkgutil.iter_modules(module.__path__):
                with contextlib.suppress(Exception):
                    importlib.import_module(f"app.loops.{found.name}")


def serve_if_forkserver() -> None:
    """In the forkserver a launcher started (:func:`start`), while it imports its preload
    (app/launch/forkserver_preload.py): tie it to the launcher and import the profile's modules.
    Anywhere else, nothing."""
    from app.launch.private import in_forkserver_preload

    raw = os.environ.get(MARKER, "")
    pid, _, profile = raw.partition(":")
    if pid.isdigit() and in_forkserver_preload():
        _serve(int(pid), profile)
