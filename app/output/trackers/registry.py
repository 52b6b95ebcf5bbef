"""The trackers ``loop.trackers`` can name, and their checks before any rank starts: a name
that is none of them, or whose package is not installed, is one line (exit 2)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from app.errors import ConfigError
from app.output.trackers.base import Tracker
from app.output.trackers.mlflow import MLflow
from app.output.trackers.tensorboard import TensorBoard
from app.output.trackers.wandb import WeightsAndBiases, check_login

TRACKERS: dict[str, type[Tracker]] = {
    tracker.name: tracker for tracker in (TensorBoard, WeightsAndBiases, MLflow)}
# What the trackers may write in a run dir (the closing summary lists those that exist).
FOLDERS = tuple(t.folder for t in TRACKERS.values() if t.folder)


def check_trackers(names: Sequence[str]) -> None:
    """Every name is a tracker, each one's package is installed, and an online W&B run has
    credentials (run by the launcher before any rank starts)."""
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"loop.trackers: unknown tracker {name!r}; one of "
                              f"{', '.join(TRACKERS)}")
    for name in names:
        tracker = TRACKERS[name]
        if not installed(tracker.package):
            raise ConfigError(
                f"loop.trackers: {name} needs the {tracker.package} package; "
                f"pip install -c constraints.txt -e '.[{tracker.extra}]'")
    if WeightsAndBiases.name in names:
        check_login()


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (a blocked module, None in
    ``sys.modules``, counts as missing)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
