"""The app's errors; each message is one line a user can act on (``error: ...`` on stderr)."""

from __future__ import annotations

import contextlib
import errno
import sys
from collections.abc import Iterator
from pathlib import Path

from app.api import ConfigError
from rlcomm import RlcommError

__all__ = [
    "WRITE_ERRORS",
    "ConfigError",
    "JobFailedError",
    "LaunchInterruptedError",
    "RankFailedError",
    "WriteError",
    "naming",
    "say_error",
]

# The write errors a run names in one line (a full disk, a quota, a read-only or foreign dir).
WRITE_ERRORS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}


class RankFailedError(RlcommError, RuntimeError):
    """One or more ranks failed; the message names them, why, and where their logs are."""


class JobFailedError(RlcommError, RuntimeError):
    """A sweep job failed; the message names its failing ranks and where their logs are."""


class LaunchInterruptedError(RlcommError, RuntimeError):
    """The launcher got SIGINT/SIGTERM/SIGHUP/SIGQUIT; the agent stopped every rank first."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # what a shell reports for a process killed by it


class WriteError(RlcommError):
    """A file of the run could not be written (WRITE_ERRORS); the message is the whole line."""

    exit_code = 2


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """An OSError raised inside names ``path`` when it names no file: a write through an open
    file (``handle.write``) does not say which file it was."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            err.filename = str(path)
        raise


def say_error(text: str) -> None:
    """``error: <text>`` on stderr in one write: ranks that share a stderr (torchrun's, srun's)
    and refuse at once never interleave their lines (print writes the newline apart)."""
    sys.stderr.write(f"error: {text}\n")
    sys.stderr.flush()
