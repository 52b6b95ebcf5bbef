"""TensorBoard scalars of a run (``loop.tensorboard=true``), written with torch's own
``SummaryWriter`` under ``<run dir>/tensorboard``, so ``tensorboard --logdir outputs`` shows every
run. The tensorboard package is an optional extra."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from app.errors import ConfigError

SUBDIR = "tensorboard"
HINT = "loop.tensorboard: needs the tensorboard package; pip install -e '.[tensorboard]'"


def check_tensorboard() -> None:
    """Fails with a one-line hint when the extra is not installed (run before any rank starts)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ConfigError(HINT) from None


class ScalarLog:
    """Every finite number of a metrics row becomes the scalar ``<prefix>/<key>``, stepped by
    env steps (the x-axis RL curves are compared on). ``purge_step``: a restart resumed from a
    checkpoint at ``purge_step - 1`` env steps; TensorBoard hides the events an earlier attempt
    wrote from there on, which this one writes again (SummaryWriter's ``purge_step``)."""

    def __init__(self, run_dir: Path, prefix: str, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.prefix = prefix
        self.writer: Any = SummaryWriter(log_dir=str(run_dir / SUBDIR), flush_secs=10,
                                         purge_step=purge_step)

    def write(self, row: dict[str, float], step: int) -> None:
        for key, value in row.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(f"{self.prefix}/{key}", value, global_step=step)

    def close(self) -> None:
        self.writer.close()
