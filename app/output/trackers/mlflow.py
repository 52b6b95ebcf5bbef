"""MLflow (``loop.trackers=[mlflow]``, the mlflow extra): one MLflow run per run, in
``MLFLOW_TRACKING_URI`` (a server, a database, a folder) or, without it, in a file store of
the run's own, ``<run dir>/mlruns``. The experiment is ``loop.tracker_project``, else
``MLFLOW_EXPERIMENT_NAME``, else ``rlcomm``.

A resumed run goes on with the MLflow run of the run it resumes where that run's store is
this one's (``MLFLOW_TRACKING_URI``, or a restart in the same run dir). A resume into another
run dir with the default store starts a run in the new dir's ``mlruns`` (the old dir stays as
it was), tagged ``rlcomm.resumes`` with the run it continues.

MLflow keeps its file store in maintenance mode and refuses it unless
``MLFLOW_ALLOW_FILE_STORE=true``: this tracker sets that (in rank 0's environment) when the store
it logs to is a folder, as the default is; docs/running.md shows how to read one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.output.trackers.base import TrackedRun, Tracker, flat

log = logging.getLogger(__name__)

EXPERIMENT = "rlcomm"  # without loop.tracker_project or MLFLOW_EXPERIMENT_NAME
FOLDER = "mlruns"
# MLflow's bounds on one log_batch call and on a parameter's value.
MAX_PARAMS, MAX_METRICS, MAX_VALUE = 100, 1000, 6000


def tracking_uri(run_dir: Path) -> str:
    """Where this run's MLflow run goes: ``MLFLOW_TRACKING_URI``, else the run dir's mlruns."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (run_dir.resolve() / FOLDER).as_uri()


class MLflow(Tracker):
    """The config as the run's parameters (``loop.hparams.lr``), every row's numbers as metrics
    stepped by env steps, the closing figures as metrics ``summary/<name>`` at the last step,
    the learning curve and videos as artifacts; FINISHED, or FAILED when the run failed."""

    name, package, extra, folder = "mlflow", "mlflow", "mlflow", FOLDER

    def __init__(self, run: TrackedRun) -> None:
        self.uri = tracking_uri(run.run_dir)
        if "://" not in self.uri or self.uri.startswith("file:"):
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        from mlflow.tracking import MlflowClient

        self.client: Any = MlflowClient(tracking_uri=self.uri)
        previous = dict(run.previous or {})
        self.run_id = self._same_run(previous)
        self.continued = self.run_id is not None
        if self.run_id is None:
            tags = {"rlcomm.run_dir": str(run.run_dir)}
            if previous.get("run_id"):
                tags["rlcomm.resumes"] = str(previous["run_id"])
            created = self.client.create_run(self._experiment(run.project), run_name=run.title,
                                             tags=tags)
            self.run_id = str(created.info.run_id)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        self._params(flat(run.params))

    def _same_run(self, previous: Mapping[str, Any]) -> str | None:
        """The run to go on with: the previous run's, where it is in this store."""
        run_id = previous.get("run_id")
        if not run_id or previous.get("tracking_uri") != self.uri:
            return None
        try:
            self.client.get_run(run_id)
        except Exception:  # not in this store (deleted, another server): a new run
            log.warning("mlflow: run %s is not in %s; starting a new run", run_id, self.uri)
            return None
        return str(run_id)

    def _experiment(self, project: str | None) -> str:
        name = project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except Exception:  # another run created it meanwhile
            return str(self.client.get_experiment_by_name(name).experiment_id)

    def _params(self, params: Mapping[str, Any]) -> None:
        """The config as parameters. MLflow's parameters never change: a resumed run keeps its
        first attempt's values, and a value this attempt changed is noted in the rank's log."""
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != _text(v))
        if changed:
            log.info("mlflow: run %s keeps its first values of %s", self.run_id, ", ".join(changed))
        new = [Param(k, _text(v)) for k, v in params.items() if k not in existing]
        for start in range(0, len(new), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=new[start:start + MAX_PARAMS])

    def log(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        for start in range(0, len(metrics), MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + MAX_METRICS])

    def finish(self, figures: Mapping[str, float], step: int, files: list[Path]) -> None:
        self.log(figures, step)
        for path in files:
            folder = path.parent.name if path.parent.name == "videos" else None
            self.client.log_artifact(self.run_id, str(path), artifact_path=folder)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")

    def record(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def last_step(self) -> int | None:
        last = self.client.get_run(self.run_id).data.metrics.get("env_steps")
        return int(last) if last is not None else None


def _text(value: Any) -> str:
    """A parameter's value as MLflow stores it (a string of at most MAX_VALUE characters)."""
    text = str(value)
    return text if len(text) <= MAX_VALUE else text[:MAX_VALUE - 3] + "..."
