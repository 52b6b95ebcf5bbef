"""The local launcher's rendezvous store (app/launch/local.py): its listening descriptor is
closed once, by the store that owns it, never a second time under another file's feet."""

from __future__ import annotations

import gc
import os
import tempfile

import pytest

from app.launch.local import LoopbackRendezvous

pytestmark = pytest.mark.integration


def test_the_store_closes_its_listening_descriptor_once() -> None:
    rendezvous = LoopbackRendezvous("127.0.0.1", 0, 0, 1, "test", 30)
    info = rendezvous.next_rendezvous()  # the agent holds the store past shutdown
    rendezvous.shutdown()
    with tempfile.TemporaryFile() as other:  # takes the lowest free number
        other.write(b"still open")
        other.flush()
        del info
        gc.collect()  # the store goes, closing its own descriptor
        os.fstat(other.fileno())  # EBADF if that close hit this file
        other.seek(0)
        assert other.read() == b"still open"
