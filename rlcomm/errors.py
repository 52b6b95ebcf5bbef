"""Errors raised by rlcomm. Each message is one line that names the field and the value."""

from __future__ import annotations


class RlcommError(Exception):
    """Base class of every rlcomm error."""


class LayoutError(RlcommError, ValueError):
    """A layout (world size, rank lists, sizes) that cannot be built."""


class BackendError(RlcommError, RuntimeError):
    """A backend that cannot run here (nccl without CUDA, unknown name)."""


class EnvironmentConfigError(RlcommError, RuntimeError):
    """A distributed environment variable that is missing or malformed."""


class GroupRegistrationError(RlcommError, RuntimeError):
    """A group that would overwrite another of the same mode for this rank."""


class JoinTimeoutError(RlcommError, TimeoutError):
    """Some ranks never arrived at the rendezvous within the timeout."""


class ModeNotRegisteredError(RlcommError, KeyError):
    """This rank is not a member of any group of the requested mode."""

    def __str__(self) -> str:
        # KeyError's str() would wrap the message in quotes.
        return str(self.args[0]) if self.args else ""


class PeerLostError(RlcommError, RuntimeError):
    """A rank lost its connection to ranks on another host (killed, or its link went down)."""


class MembershipError(RlcommError):
    """A membership epoch cannot be formed: members disagree, or a joiner was not admitted."""


class GroupBrokenError(MembershipError, RuntimeError):
    """A member declared this rank's epoch group broken while a call waited on it."""


class MembersLostError(MembershipError):
    """A leader's live members stayed below the minimum for the whole wait: the consequence of
    the losses it names, which are the run's cause where they left a record of their own."""


class HangError(RlcommError, RuntimeError):
    """A collective never completed; the message names the mode, the call and who is missing.

    Raised instead of the backend's bare timeout once the watchdog has diagnosed the hang; the
    message starts with ``hang in `` (the launcher reports it as the run's one cause).
    """


class CollectiveMismatchError(RlcommError, RuntimeError):
    """``debug`` mode: ranks called different collectives at one sequence number of a mode; the
    message starts with ``collective mismatch in `` and names both sides."""
