"""Experiment trackers (``loop.trackers``): TensorBoard, Weights & Biases and MLflow, each fed
the same records by rank 0 (docs/running.md, "Experiment trackers"). A tracker is one file here
(a :class:`~app.output.trackers.base.Tracker`) and one entry in ``registry.TRACKERS``."""

from app.output.trackers.base import TrackedRun, Tracker
from app.output.trackers.fanout import (
    Trackers,
    Tracking,
    close_trackers,
    finish_trackers,
)
from app.output.trackers.registry import FOLDERS, TRACKERS, check_trackers

__all__ = [
    "FOLDERS",
    "TRACKERS",
    "TrackedRun",
    "Tracker",
    "Trackers",
    "Tracking",
    "check_trackers",
    "close_trackers",
    "finish_trackers",
]
