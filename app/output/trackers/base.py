"""What an experiment tracker is: a sink of the run's records (:class:`Tracker`), opened with
what it needs to know of the run (:class:`TrackedRun`). Each tracker is one file beside this
one and one line in app/output/trackers/registry.py."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

# What a tracker calls the run's closing figures (result.json's ``summary``): summary/<name>.
SUMMARY_PREFIX = "summary/"


@dataclass(frozen=True)
class TrackedRun:
    """The run a tracker records. ``name``: the algorithm's (``ppo``); ``title``: the run's
    name in a tracker's list of runs; ``params``: the run's resolved config, nested (``layout``,
    ``loop``, ``comm``, ...); ``project`` and ``entity``: ``loop.tracker_project`` and
    ``loop.tracker_entity`` (None: the tracker's own variables decide); ``previous``: what this
    tracker recorded of the run this one resumes (app/output/trackers/fanout.py's side file),
    None for a fresh start."""

    run_dir: Path
    name: str
    title: str
    params: Mapping[str, Any]
    project: str | None = None
    entity: str | None = None
    previous: Mapping[str, Any] | None = None


class Tracker(ABC):
    """One experiment tracker. Rank 0 opens it (the constructor), feeds it every metrics row
    (:meth:`log`), the closing figures and files (:meth:`finish`), and closes it
    (:meth:`close`, after a failure too). ``continued``: it goes on with the tracker run of the
    run this one resumes (then no row at or below that run's last step is logged again)."""

    name: ClassVar[str]  # as loop.trackers names it
    package: ClassVar[str]  # the module it needs
    extra: ClassVar[str]  # the pyproject extra that installs it
    folder: ClassVar[str | None] = None  # what it writes in the run dir, if anything
    continued: bool = False

    @abstractmethod
    def __init__(self, run: TrackedRun) -> None:
        """Opens the tracker's run for ``run``, or goes on with ``run.previous``'s."""

    @abstractmethod
    def log(self, values: Mapping[str, float], step: int) -> None:
        """One metrics row's finite values, at ``step`` (the row's env steps)."""

    @abstractmethod
    def finish(self, figures: Mapping[str, float], step: int, files: list[Path]) -> None:
        """The run's closing figures (numbers only, named ``summary/<name>``) at ``step``, and
        its files (the learning curve, evaluation videos) as artifacts."""

    @abstractmethod
    def close(self, failed: bool) -> None:
        """Ends the tracker run (marked failed where the tracker has such a mark)."""

    def record(self) -> dict[str, Any]:
        """What a resume needs to go on with this tracker's run (its id, where it logs)."""
        return {}

    def last_step(self) -> int | None:
        """The last step the tracker itself holds for a run it goes on with, where it can
        tell (MLflow's store, a resumed online W&B run); None where it cannot."""
        return None


def finite(row: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of ``row`` (NaN marks a figure a row does not have)."""
    return {key: float(value) for key, value in row.items()
            if isinstance(value, (int, float)) and math.isfinite(value)}


def summary_figures(summary: Mapping[str, Any], prefix: str = SUMMARY_PREFIX) -> dict[str, float]:
    """Every number of result.json's ``summary``, nested ones named with dots (``eval.
    return_mean``), yes/no as 1/0; text and the files are left out."""
    figures: dict[str, float] = {}
    for key, value in summary.items():
        if key == "files":
            continue
        if isinstance(value, Mapping):
            figures.update(summary_figures(value, f"{prefix}{key}."))
        elif isinstance(value, (bool, int, float)) and math.isfinite(value):
            figures[f"{prefix}{key}"] = float(value)
    return figures


def flat(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested parameters as one level, named with dots (``loop.hparams.lr``)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
