"""How gloo's error text is read (rlcomm/net/gloo_words.py): each wording below is one gloo has
raised in this project's runs; tests/integration/test_local_launcher_private_apis.py checks the
main ones against a real gloo."""

from __future__ import annotations

import pytest

from rlcomm.net.gloo_words import describe_loss, says_peer_closed_or_timed_out, says_peer_lost

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "lost", "closed_or_timed_out", "loss"), [
    ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4567",
     True, True, "connection closed"),
    ("Read error [127.0.0.1]:7: Connection reset by peer", True, True, "connection closed"),
    ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv operation "
     "to complete", False, True, "timed out"),
    # Another operation on a pair that a timeout closed: a link that went down, seen by the
    # second of two posted operations (a SLURM run whose host2 link was cut).
    ("Application timeout caused pair closure", False, True, "timed out"),
    ("[../gloo/transport/tcp/pair.cc:598] writev: Broken pipe", False, False, "connection closed"),
    ("something else entirely", False, False, "something else entirely"),
], ids=["closed", "reset", "timed out", "pair closed by a timeout", "broken pipe", "other"])
def test_gloos_words_for_a_lost_peer_and_a_timeout(
        text: str, lost: bool, closed_or_timed_out: bool, loss: str) -> None:
    assert says_peer_lost(text) == lost
    assert says_peer_closed_or_timed_out(text) == closed_or_timed_out
    assert describe_loss(RuntimeError(text)) == loss
