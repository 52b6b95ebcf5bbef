"""A run dir (or a sweep dir) belongs to one run: the lock that says whose it is.

A live run holds ``fcntl.flock(LOCK_EX)`` on ``<dir>/.rlcomm-lock``, on a descriptor it keeps
open until it exits; the file records the run's identity, pid, host and start time. The kernel
drops the lock when that process ends, however it ends, so a record whose lock can be taken is
stale: it says whose the dir was. Who holds it: the ``python -m app`` process of a local launch
(it outlives its ranks), or rank 0 of a joined job (torchrun, SLURM, ...), whose other ranks only
read the record. The check runs in a Hydra callback (:class:`RunDirLock`), before Hydra writes
``.hydra/`` and before any rank starts.

The rules (docs/data-safety.md):

- held by a live process: refused, naming the holder;
- free, and the record names this very run (an elastic restart, a requeued SLURM job, a host that
  rejoins), unfinished or stopped by SIGTERM (``result.json`` says ``stopped``): the run
  continues in its own dir;
- free, and the dir holds a finished run (``result.json``), or an unfinished run of another
  run, or an earlier sweep: refused, saying how to continue it or start fresh;
- a dir where no rank ever ran (only ``.hydra/`` and the layout pictures: a plan, or a config
  refused before launch) holds no run and may be reused.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from app.api import RankEnv
from app.errors import ConfigError, say_error
from app.launch.environment import resolve_rank_env

LOCK_NAME = ".rlcomm-lock"
Kind = Literal["run", "sweep"]
# What a run (a sweep) leaves in its dir: any of them means the dir holds one. Other files (a
# dir a user chose that also holds their own files) do not count, nor does what a run leaves
# before any rank starts (.hydra/, the layout pictures): a plan, or a config that was refused, is
# no run, and fixing the config and running again into the same dir must work.
RUN_MARKERS = ("result.json", "metrics.csv", "logs", "checkpoints")
SWEEP_MARKERS = ("multirun.yaml", "summary.json", ".submitit")
FINISHED = "result.json"  # rank 0 writes it last, once the run succeeded
_READ_TRIES = 40  # x 0.05 s: a holder writes its record right after creating the file

_held: dict[Path, tuple[int, str]] = {}  # dir -> (descriptor holding its lock, run), for life
_identity = f"local-{uuid.uuid4().hex[:8]}"  # this `python -m app`'s own run, when it joins none


class RunDirError(ConfigError):
    """A run dir another run holds or has used; the message is the whole error line."""


@dataclass(frozen=True)
class Holder:
    """What a lock file records about the run that took the dir."""

    run: str
    pid: int
    host: str
    started: float
    kind: str = "run"
    plan_only: bool = False

    @property
    def since(self) -> str:
        return datetime.fromtimestamp(self.started, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

    def describe(self) -> str:
        return f"run {self.run} (pid {self.pid} on {self.host} since {self.since})"

    def describe_stale(self) -> str:
        return f"stale lock of pid {self.pid} on {self.host} since {self.since} (run {self.run})"


def run_identity(env: RankEnv | None = None) -> str:
    """Which run this process belongs to, the same on every rank and attempt of one job: a
    joined job's name (torchrun's rdzv id, SLURM's job and step, ...), else a fresh id per
    ``python -m app``."""
    env = resolve_rank_env() if env is None else env
    if not env.joins:
        return _identity
    return env.run_name or f"{env.launcher}-{env.master_addr}:{env.master_port}"


def read_holder(directory: Path, tries: int = _READ_TRIES) -> Holder | None:
    """The record in ``directory``'s lock file; None when there is none (or not yet: a holder
    writes it right after creating the file, so an empty or partial one is read again)."""
    path = directory / LOCK_NAME
    for attempt in range(tries):
        try:
            return _parse(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError):
            if attempt + 1 < tries:
                time.sleep(0.05)
    return None


def _parse(raw: bytes) -> Holder:
    data = json.loads(raw)
    return Holder(**{k: data[k] for k in Holder.__dataclass_fields__ if k in data})


def _finished(directory: Path) -> bool:
    """Whether the dir's run ended for good. One asked to stop (SIGTERM: a batch system's
    preemption or requeue) wrote a result that says ``stopped``, and its own job may go on."""
    try:
        return json.loads((directory / FINISHED).read_bytes()).get("status") != "stopped"
    except FileNotFoundError:
        return False
    except (OSError, ValueError, AttributeError):
        return True  # a result that cannot be read is not taken over


def _markers(directory: Path, kind: Kind) -> list[str]:
    names = RUN_MARKERS if kind == "run" else SWEEP_MARKERS
    return [n for n in names if (directory / n).exists()]


def _refusal(
    key: str, directory: Path, kind: Kind, holder: Holder | None, identity: str, resumable: bool
) -> str | None:
    """Why this run may not use ``directory`` now that nobody holds it; None when it may."""
    if holder is not None and holder.run == identity and not _finished(directory):
        return None  # this run continuing: an elastic restart, a requeued job, a rejoining host
    found = _markers(directory, kind)
    if not found:
        return None
    fresh = f"to start fresh, choose another {key}"
    if kind == "sweep":
        who = f" ({holder.describe_stale()})" if holder is not None else ""
        return f"{key}: {directory} holds an earlier sweep{who}; {fresh}"
    if FINISHED in found:
        ended = "a finished run" if _finished(directory) else "a run stopped by a signal"
        what = ended + (f" ({holder.describe()})" if holder is not None else "")
    elif holder is not None:
        what = f"an unfinished run ({holder.describe_stale()}, no longer running)"
    else:
        what = f"files of an earlier run ({', '.join(found)})"
    how = (f"to continue it, pass loop.resume={directory} with a new {key}; "
           if resumable else "")
    return f"{key}: {directory} holds {what}; {how}{fresh}"


def claim(
    directory: Path, key: str, kind: Kind = "run", *, identity: str | None = None,
    resumable: bool = False, plan_only: bool = False,
) -> Holder | None:
    """Take ``directory`` for this run and hold it until this process ends; raises
    :class:`RunDirError` (one line) when another run holds it or has used it. Returns the stale
    record this run continues from (its own earlier attempt), else None."""
    directory = Path(os.path.abspath(directory))
    identity = run_identity() if identity is None else identity
    if directory in _held and _held[directory][1] == identity:
        return None  # taken already (a second compose in this process)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = _lock(directory, key)
    except OSError as err:
        raise RunDirError(f"{key}: cannot lock {directory}: {err.strerror or err}") from None
    try:
        # Held now: nobody writes the record, an empty or broken one is no record.
        previous = read_holder(directory, tries=1)
        problem = _refusal(key, directory, kind, previous, identity, resumable)
        if problem is not None:
            if previous is None and os.fstat(fd).st_size == 0:
                (directory / LOCK_NAME).unlink(missing_ok=True)  # created by this refused run
            raise RunDirError(problem)
        mine = Holder(identity, os.getpid(), socket.gethostname(), time.time(), kind, plan_only)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(asdict(mine)).encode(), 0)
            os.fsync(fd)
        except OSError as err:  # a full or read-only disk: one line, before anything starts
            raise RunDirError(f"{key}: cannot lock {directory}: {err.strerror or err} writing "
                              f"{directory / LOCK_NAME}") from None
    except BaseException:
        os.close(fd)  # a refused run leaves the record as it found it
        raise
    _held[directory] = (fd, identity)
    return previous if previous is not None and previous.run == identity else None


def _lock(directory: Path, key: str) -> int:
    """A descriptor on ``directory``'s lock file holding its lock; RunDirError if a live run
    holds it. Retries when the file was removed between open and lock (a refused run removes
    the empty one it created; a user may delete one)."""
    import fcntl

    path = directory / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_holder(directory)
            who = holder.describe() if holder is not None else "another run"
            raise RunDirError(
                f"{key}: {directory} is in use by {who}; wait for it to end, or choose "
                f"another {key}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        os.close(fd)


def check_as_peer(
    directory: Path, key: str, *, identity: str | None = None, resumable: bool = False,
    timeout_s: float = 60.0,
) -> None:
    """For a rank other than 0 of a joined job, which only reads the record. Returns once rank
    0 of this run has taken the dir (its record names this run): nothing of this rank may land
    in the dir before, or rank 0 would find it there. Refuses at once a dir that holds another
    run's files, as rank 0 does; waits up to ``timeout_s`` for rank 0 otherwise."""
    directory = Path(os.path.abspath(directory))
    identity = run_identity() if identity is None else identity
    deadline = time.monotonic() + timeout_s
    while True:
        holder = read_holder(directory)
        if holder is not None and holder.run == identity:
            return  # rank 0 took it (or this run's earlier attempt did: rank 0 checks that)
        problem = _refusal(key, directory, "run", holder, identity, resumable)
        if problem is not None:
            raise RunDirError(problem)
        if time.monotonic() > deadline:
            who = f"it belongs to {holder.describe()}" if holder is not None else "no lock record"
            raise RunDirError(f"{key}: {directory}: rank 0 did not take it within "
                              f"{timeout_s:.0f} s ({who})")
        time.sleep(0.05)


def release(directory: Path) -> None:
    """Drop this process's lock on ``directory`` (the process's end does it otherwise)."""
    held = _held.pop(Path(os.path.abspath(directory)), None)
    if held is not None:
        os.close(held[0])


def withdraw_sweep(directory: Path) -> None:
    """A sweep refused before any job started leaves no marker in its dir (Hydra's
    ``multirun.yaml``): fixing the config and running again into the same dir must work. Only
    for a dir this process holds, where such a file can only be this sweep's."""
    if Path(os.path.abspath(directory)) in _held:
        (directory / "multirun.yaml").unlink(missing_ok=True)


class RunDirLock(Callback):
    """Takes the run dir (``on_run_start``) or the sweep dir (``on_multirun_start``) before
    Hydra writes anything there; a refusal is one ``error:`` line and exit code 2."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # The dir is resolved once, here, and pinned: a name resolved again later (the default
        # one holds the time) would name another dir than the one checked.
        HydraConfig.instance().set_config(config)  # as run_job does before it resolves it
        directory = str(config.hydra.run.dir)
        with read_write(config.hydra.run):
            config.hydra.run.dir = directory
        env = resolve_rank_env()
        resumable = OmegaConf.select(config, "loop.resume", default="absent") != "absent"
        plan_only = bool(OmegaConf.select(config, "plan_only", default=False))
        try:
            if env.joins and env.rank != 0:
                timeout = float(OmegaConf.select(config, "comm.timeout", default=60.0))
                check_as_peer(Path(directory), "hydra.run.dir", resumable=resumable,
                              timeout_s=timeout)
                return
            continued = claim(Path(directory), "hydra.run.dir", resumable=resumable,
                              plan_only=plan_only)
        except RunDirError as err:
            say_error(str(err))
            sys.exit(2)
        if continued is not None:
            print(f"hydra.run.dir: continuing {os.path.abspath(directory)} of run "
                  f"{continued.run} ({continued.describe_stale()})", file=sys.stderr, flush=True)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        env = resolve_rank_env()
        if env.joins and env.rank != 0:
            return
        try:
            claim(Path(str(config.hydra.sweep.dir)), "hydra.sweep.dir", "sweep")
        except RunDirError as err:
            say_error(str(err))
            sys.exit(2)
