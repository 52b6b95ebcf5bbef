"""Videos of whole episodes: each frame the env renders (``render_mode="rgb_array"``), written as
mp4 by imageio's ffmpeg plugin (imageio-ffmpeg, the ``video`` extra), on a machine without a
display: MuJoCo renders through EGL (Mesa's software EGL where there is no GPU) and classic
control through pygame without a window.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from app.runtime.envs.vector import EnvConfig, make_env

RENDER_MODE = "rgb_array"


class VideoError(Exception):
    """Why an environment's episodes cannot be recorded; ``str()`` is one line."""


def headless() -> None:
    """Rendering needs no display: set once, before the first env renders (a value the user set
    is kept)."""
    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # pygame: no window
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")


def make_rendering_env(cfg: EnvConfig) -> Any:
    """One env of ``cfg`` that renders frames; VideoError naming the reason when it cannot."""
    headless()
    try:
        env = make_env(cfg.id, cfg._target_, {**cfg.kwargs, "render_mode": RENDER_MODE})
    except Exception as err:  # a missing renderer (pygame), or a factory without render_mode
        raise VideoError(f"{cfg.id} cannot render: {_first_line(err)}") from None
    if RENDER_MODE not in env.metadata.get("render_modes", ()):
        env.close()
        raise VideoError(f"{cfg.id} cannot render {RENDER_MODE} frames (its render modes: "
                         f"{list(env.metadata.get('render_modes', ()))})")
    _fast_mujoco_frames(env)
    return env


def _fast_mujoco_frames(env: Any) -> None:
    """MuJoCo without shadows or multisampling: on a CPU (Mesa's software EGL) a Hopper frame
    then takes about a sixth of the time, and the body is as clear. Set before the first
    frame, which creates the renderer."""
    visual = getattr(getattr(env.unwrapped, "model", None), "vis", None)
    if visual is not None and hasattr(visual, "quality"):
        visual.quality.shadowsize = 0
        visual.quality.offsamples = 0


def render_problem(cfg: EnvConfig) -> str | None:
    """Why ``cfg``'s env cannot be recorded (checked before anything runs), or None: it is
    built, reset and renders one frame."""
    try:
        env = make_rendering_env(cfg)
    except VideoError as err:
        return str(err)
    try:
        env.reset(seed=0)
        frame(env)
    except (VideoError, Exception) as err:
        return str(err) if isinstance(err, VideoError) else f"{cfg.id} cannot render: " \
            f"{_first_line(err)}"
    finally:
        env.close()
    return None


def frame(env: Any) -> np.ndarray:
    """The env's current frame, [H, W, 3] uint8."""
    image = np.asarray(env.render())
    if image.ndim != 3 or image.shape[-1] not in (3, 4) or image.dtype != np.uint8:
        raise VideoError(f"render() gave {image.dtype} {list(image.shape)}, not an RGB image")
    return image[..., :3]


class EpisodeVideo:
    """One episode's frames into ``path`` (mp4), written aside and renamed when whole."""

    def __init__(self, path: Path, fps: float) -> None:
        import imageio.v2 as imageio

        self.path = path
        self._partial = path.with_name(f".{path.stem}.partial{path.suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        # H.264 in yuv420p needs even sizes only; 16 (imageio's default) resized CartPole.
        self._writer = imageio.get_writer(self._partial, format="FFMPEG", fps=fps,
                                          codec="libx264", quality=7, macro_block_size=2)
        self.frames = 0

    def add(self, image: np.ndarray) -> None:
        self._writer.append_data(image)
        self.frames += 1

    def close(self, keep: bool = True) -> None:
        self._writer.close()
        if keep:
            os.replace(self._partial, self.path)
        else:
            with contextlib.suppress(OSError):
                self._partial.unlink()


def _first_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0][:200]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
