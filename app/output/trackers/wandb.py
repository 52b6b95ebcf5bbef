"""Weights & Biases (``loop.trackers=[wandb]``, the wandb extra): one W&B run per run, under
``<run dir>/wandb/``. The project and entity are ``loop.tracker_project`` and
``loop.tracker_entity``, else W&B's own ``WANDB_PROJECT`` and ``WANDB_ENTITY`` (the project
defaults to ``rlcomm``); ``WANDB_MODE=offline`` needs no network, and ``wandb sync`` uploads
the run later. A resumed run goes on with the W&B run of the run it resumes (the same id)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.errors import ConfigError
from app.output.trackers.base import TrackedRun, Tracker

PROJECT = "rlcomm"  # without loop.tracker_project or WANDB_PROJECT
# W&B modes that log to no server: no login needed.
LOCAL_MODES = ("offline", "dryrun", "disabled")
FLUSH_S = 1.0  # how often W&B writes its run file


def check_login() -> None:
    """Before any rank starts: an online W&B run needs credentials (``wandb login`` or
    ``WANDB_API_KEY``); without them W&B would fail rank 0 at its start. Looked up locally,
    with no network and no prompt."""
    mode = os.environ.get("WANDB_MODE", "online").lower()
    if mode in LOCAL_MODES or os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true"):
        return
    import wandb

    if not wandb.login(verify=False, prompt=False):
        raise ConfigError(
            f"loop.trackers: wandb logs online (WANDB_MODE={mode}) and finds no credentials; "
            "run `wandb login`, set WANDB_API_KEY, or log offline with WANDB_MODE=offline")


class WeightsAndBiases(Tracker):
    """The config as the W&B run's config, every row with ``step=`` its env steps, the closing
    figures in its summary, the learning curve and videos as one artifact of type
    ``run_outputs``."""

    name, package, extra, folder = "wandb", "wandb", "wandb", "wandb"

    def __init__(self, run: TrackedRun) -> None:
        import wandb

        previous = dict(run.previous or {})
        self.run_dir = run.run_dir
        self.continued = "id" in previous
        project = previous.get("project") or run.project or os.environ.get("WANDB_PROJECT")
        entity = previous.get("entity") or run.entity
        # The console stays the app's (its progress line); W&B's own output goes to its logs.
        settings = wandb.Settings(console="off", silent=True)
        # W&B writes its run file every 15 s: rank 0 stopped by the launcher meanwhile (another
        # rank failed) would leave nothing of the last 15 s there, or of a short run at all.
        if "x_transaction_log_flush_interval" in type(settings).model_fields:
            settings.x_transaction_log_flush_interval = FLUSH_S
        self.run: Any = wandb.init(
            project=project or PROJECT, entity=entity, id=previous.get("id"),
            resume="allow" if self.continued else None, name=run.title, dir=str(run.run_dir),
            settings=settings)
        self.run.config.update(dict(run.params), allow_val_change=True)

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def finish(self, figures: Mapping[str, float], step: int, files: list[Path]) -> None:
        import wandb

        self.run.summary.update(dict(figures))
        if files:
            outputs = wandb.Artifact(f"outputs-{self.run.id}", type="run_outputs")
            for path in files:
                outputs.add_file(str(path), name=_relative(path, self.run_dir))
            self.run.log_artifact(outputs)

    def close(self, failed: bool) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # The W&B service of this process: a rank ends with os._exit, which runs no atexit.
        wandb.teardown()

    def record(self) -> dict[str, Any]:
        return {"id": self.run.id, "project": self.run.project, "entity": self.run.entity,
                "mode": self.run.settings.mode}

    def last_step(self) -> int | None:
        last = self.run.summary.get("env_steps")  # an online run resumed holds its summary
        return int(last) if isinstance(last, (int, float)) else None


def _relative(path: Path, run_dir: Path) -> str:
    """``videos/best.mp4``: a file's name in the artifact, as in the run dir."""
    try:
        return str(path.resolve().relative_to(run_dir.resolve()))
    except ValueError:
        return path.name
