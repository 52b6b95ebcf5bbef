"""What gloo's errors say, read in one place.

gloo raises a bare ``RuntimeError`` whose text alone tells why a collective failed: a peer's
connection closed, or no answer came within the group's timeout. Every reading of that text is
here; its words are pinned against a real gloo by
tests/integration/test_local_launcher_private_apis.py, so a gloo release that rewords them
fails there, not in a user's run.
"""

from __future__ import annotations

import re

# The peer's end of the connection closed: its process ended, or its sockets were closed.
PEER_CLOSED = ("Connection closed by peer", "Connection reset by peer")
# gloo's advice after a failed transfer ("typically caused by a remote worker crashing").
REMOTE_WORKER = "remote worker"
# No answer within the group's timeout: a peer stopped, or its link went down. The operation
# whose deadline passes first says "Timed out waiting ...ms"; another one on the same pair, which
# the timeout then closed, says "Application timeout caused pair closure" (which of the two a
# rank sees first is a race between its operations).
TIMED_OUT = ("Timed out", "timed out", "Application timeout caused pair closure")
# A connection that ended at either end (a send into a closed socket: a broken pipe).
CONNECTION_ENDED = ("Connection closed", "Connection reset", "Broken pipe")
# How gloo names a peer: ``[address]:port``.
PEER_ADDRESS = re.compile(r"\[(\d+\.\d+\.\d+\.\d+)\]:\d+")
# gloo's source location before its message: ``[../gloo/transport/tcp/pair.cc:598] ``.
_LOCATION = re.compile(r"^\[[^\]]*:\d+\]\s*")


def says_peer_lost(text: str) -> bool:
    """The text says a peer went away: its connection closed, or a remote worker crashed."""
    return any(word in text for word in (*PEER_CLOSED, REMOTE_WORKER))


def says_peer_closed_or_timed_out(text: str) -> bool:
    """The text says a peer's connection closed or a collective timed out: either may mean
    the peer's host is gone (a host that died closes nothing, its link only times out)."""
    return any(word in text for word in (*PEER_CLOSED, *TIMED_OUT))


def peer_addresses(text: str) -> list[str]:
    """The peers' addresses the text names, in order."""
    return PEER_ADDRESS.findall(text)


def gist(err: BaseException) -> str:
    """The first sentence of a backend error, without gloo's source location prefix."""
    lines = str(err).strip().splitlines()
    text = _LOCATION.sub("", lines[0]) if lines else ""
    return text.split(". ")[0]


def describe_loss(err: BaseException) -> str:
    """Why a peer's transfer failed, in a few words (gloo's message without its location)."""
    text = str(err)
    if any(word in text for word in CONNECTION_ENDED):
        return "connection closed"
    if any(word in text for word in TIMED_OUT):
        return "timed out"  # the group's timeout
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return first.split("] ", 1)[-1][:160]
