"""The trackers of one run dir across a failure and a restart there (a requeued SLURM job, an
elastic restart: app/output/trackers/fanout.py), with the real trackers in this process: the
failed attempt's tracker runs are marked failed, the restart goes on with the same runs from
its checkpoint and logs no step they already hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.output.trackers import Tracking, close_trackers, finish_trackers
from tests.helpers.wandb_files import read_offline_run

pytestmark = pytest.mark.integration


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("DATA", "CACHE", "CONFIG"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wb-{name.lower()}"))
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the test reads MLflow's store too


def row(step: int) -> dict[str, float]:
    return {"env_steps": step, "loss": step / 100, "mean_return": float("nan")}


@pytest.mark.usefixtures("offline_wandb")
def test_a_restart_in_the_same_run_dir_goes_on_with_its_failed_tracker_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # The project from W&B's and MLflow's own variables, the entity from loop.tracker_entity.
    monkeypatch.setenv("WANDB_PROJECT", "from-wandb-env")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-mlflow-env")
    tracking = Tracking(("tensorboard", "wandb", "mlflow"), entity="my-team",
                        params={"loop": {"window": 20}})
    first = tracking.open(run_dir, "ppo", "ppo CartPole-v1")
    for step in (100, 200, 300):
        first.log(row(step), step)
    close_trackers(failed=True)  # as app/launch/rank.py does when the rank fails

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (failed,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert failed.info.status == "FAILED"
    assert client.get_experiment(failed.info.experiment_id).name == "from-mlflow-env"
    (wandb_first,) = (run_dir / "wandb").glob("offline-run-*")
    first_run = read_offline_run(wandb_first)
    assert first_run.exit_code == 1
    assert (first_run.project, first_run.entity) == ("from-wandb-env", "my-team")

    # As if rank 0 had died between MLflow's last log and the side file's write: the side file
    # says 200, MLflow's store holds 300, and the store counts.
    side = json.loads((run_dir / "trackers.json").read_text())
    assert {name: record["last_step"] for name, record in side.items()} == {
        "tensorboard": 300, "wandb": 300, "mlflow": 300}
    side["mlflow"]["last_step"] = 200
    (run_dir / "trackers.json").write_text(json.dumps(side))

    # The restart resumes from its checkpoint at step 100 in the same run dir.
    restarted = Tracking(tracking.names, params=tracking.params,
                         resumes=run_dir / "checkpoints" / "ckpt_000001.pt")
    second = restarted.open(run_dir, "ppo", "ppo CartPole-v1")
    assert [t.continued for t in second.trackers] == [True, True, True]
    for step in (200, 300, 400):
        second.log(row(step), step)
    finish_trackers({"env_steps": 400, "solved": False, "files": {}})

    (finished,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert finished.info.run_id == failed.info.run_id and finished.info.status == "FINISHED"
    history = client.get_metric_history(finished.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(100, 1.0), (200, 2.0), (300, 3.0),
                                                          (400, 4.0)]
    assert not client.get_metric_history(finished.info.run_id, "mean_return")  # NaN: none
    assert finished.data.metrics["summary/solved"] == 0 and finished.data.params == {
        "loop.window": "20"}

    runs = [read_offline_run(f) for f in sorted((run_dir / "wandb").glob("offline-run-*"))]
    assert len(runs) == 2 and runs[0].run_id == runs[1].run_id and runs[1].resumable
    assert sorted(runs[0].history) == [100, 200, 300] and sorted(runs[1].history) == [400]
    assert runs[1].exit_code == 0 and runs[1].summary["summary/env_steps"] == 400

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("ppo/loss")] == [100, 200, 300, 400]


@pytest.mark.usefixtures("offline_wandb")
def test_a_resume_from_another_run_dir_starts_a_new_mlflow_run_in_its_own_store(
    tmp_path: Path,
) -> None:
    """The default store is the run dir's own: the old run dir is never written again, so the
    resume logs to a new MLflow run in the new dir, tagged with the run it continues."""
    from mlflow.tracking import MlflowClient

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    first = Tracking(("mlflow",)).open(old, "ppo", "ppo CartPole-v1")
    first.log(row(100), 100)
    finish_trackers({"env_steps": 100, "files": {}})
    before = sorted(p.name for p in (old / "mlruns").rglob("*"))

    second = Tracking(("mlflow",), resumes=old / "checkpoints" / "ckpt_000001.pt").open(
        new, "ppo", "ppo CartPole-v1")
    assert not second.trackers[0].continued
    second.log(row(200), 200)
    finish_trackers({"env_steps": 200, "files": {}})

    assert sorted(p.name for p in (old / "mlruns").rglob("*")) == before
    (old_run,) = MlflowClient(tracking_uri=(old / "mlruns").as_uri()).search_runs(
        [e.experiment_id for e in MlflowClient(tracking_uri=(old / "mlruns").as_uri())
         .search_experiments()])
    client = MlflowClient(tracking_uri=(new / "mlruns").as_uri())
    (new_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert new_run.data.tags["rlcomm.resumes"] == old_run.info.run_id
    assert [m.step for m in client.get_metric_history(new_run.info.run_id, "loss")] == [200]
