"""Time to answer (from the command to its first line, and from the stop to the exit), the pieces
in this process: the run's phases from its recorded marks, which command lines start a
forkserver early, background work and its errors, and the errors of the launcher's picture
service. What takes another process (a process's start time, the picture service asked from
another process) is tests/integration/test_startup.py; whole runs (ranks from the preloaded
forkserver, the pictures when a run reports success, a finished rank that will not exit) are
tests/e2e/test_startup.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from app.launch.forkserver import early_profile
from app.output import background, pictures, timeline
from tests.helpers.apprun import HANG_S

pytestmark = pytest.mark.unit


def test_the_phases_follow_one_another_from_the_recorded_marks() -> None:
    marks = {
        "start": 100.0, "validated": 102.0, "result": 130.0,
        "ranks": {
            "0": {"started": 103.0, "groups": 103.5, "first_update": 105.0, "stop": 125.0},
            "1": {"started": 103.2, "groups": 103.6, "first_update": 105.5, "stop": 125.1},
        },
    }
    assert timeline.phases(marks) == {
        "compose_validate_s": 2.0, "spawn_import_s": 1.2, "rendezvous_groups_s": 0.4,
        "first_update_s": 1.9, "training_s": 19.5, "stop_to_result_s": 5.0,
    }
    del marks["ranks"]["0"]["stop"], marks["ranks"]["1"]["stop"]  # a loop that marks no stop
    assert timeline.phases(marks)["training_s"] is None
    assert timeline.phases(marks)["stop_to_result_s"] is None


def test_which_command_lines_start_a_forkserver_before_their_config_is_composed() -> None:
    assert early_profile([], joins=False) == "ranks"
    assert early_profile(["layout=1t3r", "--multirun", "seed=0,1"], joins=False) == "ranks"
    assert early_profile(["plan_only=true"], joins=False) == "picture"
    assert early_profile(["+plan_only=True"], joins=False) == "picture"
    assert early_profile(["plan_only=false"], joins=False) == "ranks"
    for args in (["--help"], ["--cfg", "job"], ["-c", "job"], ["--info"],
                 ["--multirun", "hydra/launcher=rlcomm_slurm"]):
        assert early_profile(args, joins=False) is None, args
    assert early_profile([], joins=True) is None  # a rank of torchrun's or SLURM's


def test_background_work_is_waited_for_and_its_error_raised_in_the_waiter(tmp_path: Path) -> None:
    written = tmp_path / "curve.png"
    background.in_background(lambda: (time.sleep(0.2), written.write_text("drawn")), name="curve")
    background.wait_for_background(10)
    assert written.read_text() == "drawn" and background.pending() == []

    def fail() -> None:
        raise OSError(28, "No space left on device", str(tmp_path / "curve.png"))

    background.in_background(fail, name="curve")
    with pytest.raises(OSError) as raised:
        background.wait_for_background(10)
    assert raised.value.filename == str(tmp_path / "curve.png")
    background.wait_for_background(10)  # raised once, then forgotten

    background.in_background(time.sleep, 1, name="slow file")
    with pytest.raises(TimeoutError, match="slow file still being written after 0.1 s"):
        background.wait_for_background(0.1)


def test_the_layout_pictures_error_and_a_drawing_that_hangs_are_raised_by_wait() -> None:
    def fail() -> Path:
        raise OSError(28, "No space left on device", "/run/layout.png")

    with pytest.raises(OSError) as raised:
        pictures.PictureService(fail).wait(HANG_S)
    assert raised.value.filename == "/run/layout.png"

    release = threading.Event()
    hung = pictures.PictureService(lambda: (release.wait(HANG_S), Path("layout.png"))[1])
    with pytest.raises(TimeoutError, match=r"^layout picture: not done after 0.2 s$"):
        hung.wait(0.2)
    release.set()
    assert hung.wait(HANG_S) == Path("layout.png")
