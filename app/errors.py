"""The app's errors; each message is one line a user can act on (``error: ...`` on stderr)."""

from __future__ import annotations

from app.api import ConfigError
from rlcomm import RlcommError

__all__ = ["ConfigError", "JobFailedError", "LaunchInterruptedError", "RankFailedError"]


class RankFailedError(RlcommError, RuntimeError):
    """One or more ranks failed; the message names them, why, and where their logs are."""


class JobFailedError(RlcommError, RuntimeError):
    """A sweep job failed; the message names its failing ranks and where their logs are."""


class LaunchInterruptedError(RlcommError, RuntimeError):
    """The launcher got SIGINT/SIGTERM/SIGHUP/SIGQUIT; the agent stopped every rank first."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # what a shell reports for a process killed by it
