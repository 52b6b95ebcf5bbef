"""``loop.threads`` per rank against the host's cores: the warning a rank's launch logs."""

from __future__ import annotations

import pytest

from app.launch.rank import oversubscribed

pytestmark = pytest.mark.unit


def test_more_threads_than_cores_over_the_ranks_of_a_host_names_the_setting_and_the_share() -> None:
    line = oversubscribed(threads=2, ranks_here=3, cores=2)
    assert line is not None
    assert line.startswith("loop.threads=2 x 3 ranks on this host = 6 threads on 2 cores")
    assert "loop.threads=0" in line and "(1)" in line


def test_threads_that_fit_the_cores_and_the_launchers_share_say_nothing() -> None:
    assert oversubscribed(threads=2, ranks_here=1, cores=2) is None  # layout=single, 2 threads
    assert oversubscribed(threads=1, ranks_here=2, cores=2) is None
    assert oversubscribed(threads=0, ranks_here=8, cores=2) is None  # the launcher's share
