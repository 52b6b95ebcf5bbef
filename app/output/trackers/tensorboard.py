"""TensorBoard (``loop.trackers=[tensorboard]``, or ``loop.tensorboard=true``): scalars written
with torch's own ``SummaryWriter`` under ``<run dir>/tensorboard``, so ``tensorboard --logdir
outputs`` shows every run. The tensorboard package is an optional extra."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.errors import ConfigError
from app.output.trackers.base import TrackedRun, Tracker

SUBDIR = "tensorboard"
HINT = "loop.tensorboard: needs the tensorboard package; pip install -e '.[tensorboard]'"


def check_tensorboard() -> None:
    """Fails with a one-line hint when the extra is not installed (run before any rank starts)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ConfigError(HINT) from None


class TensorBoard(Tracker):
    """Every finite number of a metrics row becomes the scalar ``<algorithm>/<column>``, stepped
    by env steps (the x-axis RL curves are compared on); the config is a text, the closing
    figures are scalars ``<algorithm>/summary/<name>`` and the learning curve an image at the
    last step. TensorBoard plays no video: the evaluation videos stay in the run dir. A restart
    in the same run dir goes on in the same event files."""

    name, package, extra, folder = "tensorboard", "tensorboard", "tensorboard", SUBDIR

    def __init__(self, run: TrackedRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.prefix = run.name
        self.log_dir = str(run.run_dir / SUBDIR)
        self.continued = run.previous is not None and run.previous.get("log_dir") == self.log_dir
        self.writer: Any = SummaryWriter(log_dir=self.log_dir, flush_secs=10)
        if not self.continued:
            from omegaconf import OmegaConf

            text = OmegaConf.to_yaml(OmegaConf.create(dict(run.params)))
            self.writer.add_text(f"{self.prefix}/config", f"```\n{text}```", global_step=0)

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{self.prefix}/{key}", value, global_step=step)

    def finish(self, figures: Mapping[str, float], step: int, files: list[Path]) -> None:
        self.log(figures, step)
        for path in files:
            if path.suffix == ".png":
                import numpy as np
                from PIL import Image  # matplotlib's own dependency

                with Image.open(path) as image:
                    pixels = np.asarray(image.convert("RGB"))
                self.writer.add_image(f"{self.prefix}/{path.stem}", pixels, global_step=step,
                                      dataformats="HWC")

    def close(self, failed: bool) -> None:
        self.writer.close()

    def record(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir}
