"""Reading back the mp4 files a run or an evaluation recorded (tests of app/runtime/evaluation/video.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def read_frames(path: Path) -> list[np.ndarray]:
    """Every frame of the video at ``path``, [H, W, 3] uint8."""
    import imageio.v2 as imageio

    with imageio.get_reader(path) as reader:
        return [np.asarray(frame) for frame in reader]
