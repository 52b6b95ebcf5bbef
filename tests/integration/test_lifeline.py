"""The lifeline (app/launch/lifeline.py), with real processes: a rank whose launcher died before
the rank could tie itself to it (the local launcher's, or torchrun's) stops at once. A killed
launcher taking its running ranks along is tests/e2e/test_orphans.py."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import psutil
import pytest

from app.launch.lifeline import tie_to_launcher
from tests.helpers.apprun import running

pytestmark = pytest.mark.integration
GONE_S = 20.0  # the rank is gone this soon after its launcher died


def _late_rank(report: str, launcher_kind: str) -> None:
    """A rank whose launcher died before the rank tied itself to it (spawned as the agent
    spawns its ranks; as torchrun's, it is told so by torchrun's variables)."""
    launcher = multiprocessing.parent_process()
    assert launcher is not None
    while os.getppid() == launcher.pid:  # until the launcher is gone and this rank was adopted
        time.sleep(0.01)
    Path(report).write_text(f"{os.getpid()} adopted by {os.getppid()}\n")
    if launcher_kind == "torchrun":
        os.environ.update({"TORCHELASTIC_RUN_ID": "orphan", "RANK": "0", "WORLD_SIZE": "1"})
    tie_to_launcher(launched_here=launcher_kind == "local")
    with Path(report).open("a") as handle:  # the lifeline failed
        handle.write("survived\n")
    time.sleep(120)


def _dying_launcher(report: str, launcher_kind: str) -> None:
    multiprocessing.get_context("spawn").Process(target=_late_rank,
                                                 args=(report, launcher_kind)).start()
    os._exit(0)  # no handler and no join, as under SIGKILL


@pytest.mark.parametrize("launcher_kind", ["local", "torchrun"])
def test_a_rank_whose_launcher_died_before_it_was_tied_ends_at_once(
    tmp_path: Path, launcher_kind: str
) -> None:
    report = tmp_path / "report"
    launcher = multiprocessing.get_context("fork").Process(target=_dying_launcher,
                                                           args=(str(report), launcher_kind))
    launcher.start()
    launcher.join(30)
    assert launcher.exitcode == 0
    deadline = time.monotonic() + 120  # the spawned rank imports this module first
    while not (report.exists() and report.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert report.exists() and report.read_text(), "the rank never ran"
    first = report.read_text().splitlines()[0].split()  # "<pid> adopted by <pid>"
    pid, adopter = first[0], first[-1]
    try:
        rank = [psutil.Process(int(pid))]
    except psutil.NoSuchProcess:
        rank = []
    deadline = time.monotonic() + GONE_S
    while running(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = running(rank)
    for proc in left:
        proc.kill()
    if launcher_kind == "torchrun" and adopter != "1":
        pytest.skip(f"adopted by a subreaper (pid {adopter}), which a torchrun rank cannot tell "
                    "from its agent")
    assert not left and report.read_text() == f"{pid} adopted by {adopter}\n", report.read_text()
