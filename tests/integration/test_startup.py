"""Time to answer, the pieces that take another process: a process's start read to the kernel's
tick, and the launcher's picture service drawing for another process. What runs in this process
alone is tests/unit/test_startup.py; whole runs are tests/e2e/test_startup.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.output import pictures, timeline
from tests.helpers.apprun import HANG_S

pytestmark = pytest.mark.integration


def test_a_process_start_is_read_to_the_kernels_tick() -> None:
    # compose_validate_s starts here: read to the tick, not to /proc/stat's whole-second btime.
    before = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    after = time.time()
    try:
        started = timeline.process_start_time(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - 2 * tick <= started <= after + 2 * tick, (before, started, after)



PICTURE_CLIENT = """
import json, os
from app.output import pictures

try:
    pictures.draw(os.open, "/nonexistent/dir/curve.png", os.O_RDONLY)
    missing = None
except FileNotFoundError as err:
    missing = err.filename
print(json.dumps({"pid": os.getpid(), "drawn_by": pictures.draw(os.getpid), "missing": missing}))
"""


def test_the_launchers_picture_service_draws_for_another_process_and_raises_there(
    tmp_path: Path,
) -> None:
    layout = tmp_path / "layout.png"
    service = pictures.PictureService(lambda: (layout.write_text("drawn"), layout)[1])
    variables = service.environ()
    assert list(variables) == [pictures.ENV]
    env = {**os.environ, **variables}
    proc = subprocess.run([sys.executable, "-c", PICTURE_CLIENT], env=env, capture_output=True,
                          text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["drawn_by"] == os.getpid() != seen["pid"], seen  # drawn here, asked there
    assert seen["missing"] == "/nonexistent/dir/curve.png", seen  # its error, raised there
    assert service.wait(HANG_S) == layout and layout.read_text() == "drawn"
    # Without a service to ask (torchrun, SLURM), a rank draws in line.
    env.pop(pictures.ENV)
    proc = subprocess.run([sys.executable, "-c", PICTURE_CLIENT], env=env, capture_output=True,
                          text=True, timeout=HANG_S)
    seen = json.loads(proc.stdout)
    assert seen["drawn_by"] == seen["pid"], (seen, proc.stderr)
