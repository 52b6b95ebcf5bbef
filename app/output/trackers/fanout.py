"""A run's trackers as one sink: :class:`Tracking` says which to open, :class:`Trackers` feeds
each the same rows, then the closing figures and files, and keeps ``<run dir>/trackers.json``.

``trackers.json`` holds, per tracker, what a resume needs to go on with its run (W&B's run id,
MLflow's run id and store) and the last step it logged. It is a file of the run dir, not of the
checkpoints, because the last step logged is often past the last checkpoint (a run that
failed after it): a resume from that checkpoint goes on with the same tracker runs and logs no
step again up to that last one. It is read from the run dir of the checkpoint a run resumes
from (that dir's own after a restart, the old one for ``loop.resume``), and never written
there unless it is this run's.

Rank 0 opens the trackers when its records start (app/runtime/records/recorder.py) and the
rank finishes them once the run's summary is known (app/launch/rank.py: :func:`finish_trackers`,
or :func:`close_trackers` when it failed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.output.trackers.base import TrackedRun, Tracker, finite, summary_figures
from app.output.trackers.registry import TRACKERS

log = logging.getLogger(__name__)

SIDE_FILE = "trackers.json"
# Hydra's record of the run's composed config (written by the launching process, or by rank 0
# of a joined run, before any rank runs its loop).
RUN_CONFIG = Path(".hydra") / "config.yaml"
# The files of a run's summary (result.json's summary["files"]) that go to the trackers.
ARTIFACTS = ("learning_curve.png", "videos/best.mp4", "videos/last.mp4")

_open: list[Trackers] = []  # this process's, until finished or closed


@dataclass(frozen=True)
class Tracking:
    """Which trackers a run opens (``names``, ``loop.trackers`` with ``loop.tensorboard``), its
    ``project`` and ``entity``, its ``params`` when the run dir holds no Hydra config, and the
    checkpoint it resumed from (``resumes``), whose run dir's ``trackers.json`` they go on from."""

    names: tuple[str, ...]
    project: str | None = None
    entity: str | None = None
    params: Mapping[str, Any] | None = None
    resumes: Path | None = None

    def open(self, run_dir: Path, name: str, title: str) -> Trackers:
        """Every tracker named, opened for the run in ``run_dir`` (rank 0 only)."""
        previous = read_side_file(self.resumes) if self.resumes is not None else {}
        params = run_params(run_dir) or dict(self.params or {})
        opened: list[Tracker] = []
        try:
            for tracker_name in self.names:
                run = TrackedRun(run_dir, name, title, params, self.project, self.entity,
                                 previous.get(tracker_name))
                opened.append(TRACKERS[tracker_name](run))
        except BaseException:
            for tracker in opened:
                with contextlib.suppress(Exception):
                    tracker.close(failed=True)
            raise
        after = {t.name: _logged_up_to(t, previous.get(t.name)) for t in opened}
        trackers = Trackers(opened, run_dir / SIDE_FILE, after)
        _open.append(trackers)
        return trackers


class Trackers:
    """The open trackers of a run, fed alike. ``after``: per tracker, the last step its run
    already holds (-1 for a new run): rows at or below it are not logged to it again."""

    def __init__(self, trackers: list[Tracker], side_file: Path, after: dict[str, int]) -> None:
        self.trackers, self.side_file = trackers, side_file
        self.last = dict(after)
        self._write_side_file()

    def log(self, row: Mapping[str, Any], step: int) -> None:
        """One metrics row at ``step`` (its env steps), to every tracker that has not got it."""
        values = finite(row)
        logged = False
        for tracker in self.trackers:
            if step > self.last[tracker.name]:
                tracker.log(values, step)
                self.last[tracker.name] = step
                logged = True
        if logged:
            self._write_side_file()

    def finish(self, summary: Mapping[str, Any]) -> None:
        """The run's closing figures and files (result.json's ``summary``), then each tracker
        closed."""
        figures = summary_figures(summary)
        files = [Path(path) for name, path in summary.get("files", {}).items()
                 if name in ARTIFACTS]
        steps = summary.get("env_steps")
        step = int(steps) if isinstance(steps, int) else max(self.last.values(), default=0)
        try:
            for tracker in self.trackers:
                tracker.finish(figures, max(step, 0), files)
        except BaseException:
            self.close(failed=True)
            raise
        self.close(failed=False)

    def close(self, failed: bool) -> None:
        """Every tracker closed (each one, whatever another's close raised)."""
        if self in _open:
            _open.remove(self)
        errors = []
        for tracker in self.trackers:
            try:
                tracker.close(failed)
            except Exception as err:
                errors.append(err)
        self.trackers = []
        if errors:
            raise errors[0]

    def _write_side_file(self) -> None:
        records = {t.name: {**t.record(), "last_step": self.last[t.name]} for t in self.trackers}
        partial = self.side_file.with_name(f"{self.side_file.name}.tmp")
        partial.write_text(json.dumps(records, indent=1))
        os.replace(partial, self.side_file)


def finish_trackers(summary: Mapping[str, Any]) -> None:
    """The run succeeded: its summary to this process's open trackers, which are then closed."""
    for trackers in list(_open):
        trackers.finish(summary)


def close_trackers(failed: bool) -> None:
    """This process's open trackers closed (after a failure: marked failed where they can be);
    an error closing one is logged, not raised over the failure."""
    for trackers in list(_open):
        try:
            trackers.close(failed)
        except Exception:
            log.exception("closing the trackers failed")


def read_side_file(checkpoint: Path) -> dict[str, Any]:
    """``trackers.json`` of the run dir that holds ``checkpoint`` (``<run dir>/checkpoints/
    ckpt_N.pt`` or ``ckpt_N/``); empty where that run had no trackers."""
    path = checkpoint.parent.parent / SIDE_FILE
    try:
        records: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return records


def run_params(run_dir: Path) -> dict[str, Any] | None:
    """The run's config as Hydra composed it, resolved (``layout``, ``loop``, ``comm``, ...);
    None where the run dir holds none (the app run without Hydra)."""
    from omegaconf import OmegaConf

    path = run_dir / RUN_CONFIG
    if not path.is_file():
        return None
    config = OmegaConf.load(path)
    try:
        params = OmegaConf.to_container(config, resolve=True)
    except Exception:  # an interpolation this process cannot resolve: kept as written
        params = OmegaConf.to_container(config, resolve=False)
    return {str(k): v for k, v in params.items()} if isinstance(params, dict) else None


def _logged_up_to(tracker: Tracker, previous: Mapping[str, Any] | None) -> int:
    """The last step the run a tracker goes on with holds: what the previous run recorded, or
    what the tracker itself says, whichever is later; -1 for a new tracker run."""
    if not tracker.continued:
        return -1
    recorded = int((previous or {}).get("last_step", -1))
    told = tracker.last_step()
    return max(recorded, told if told is not None else -1)
