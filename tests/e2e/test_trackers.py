"""Experiment trackers (``loop.trackers``, docs/running.md) on real runs of ``python -m app``,
offline: W&B with ``WANDB_MODE=offline`` (its transaction log read back), MLflow in a file
store (read back through MLflow's own client). Each gets the run's config, every metrics column
at its env steps, the summary's figures and the learning curve and videos; only rank 0 logs; a
resume goes on with the same tracker runs and logs no step twice; a tracker that is not
installed, or W&B online without credentials, is one line and exit 2 before any rank starts."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.apprun import describe, metrics, read_result, run_app
from tests.helpers.wandb_files import OfflineRun, read_offline_run

pytestmark = pytest.mark.e2e

PER_UPDATE = 2048  # env steps per update on the default layout (2t2r) and loop (PPO)
SMALL = ("loop.target_return=1e9", "loop.stop_at_target=false", "loop.progress=false")
TIMEOUT_S = 240


def offline(tmp_path: Path, **more: str) -> dict[str, str]:
    """W&B offline, its caches in ``tmp_path`` (never the home dir); MLflow's variables unset
    unless given."""
    return {"WANDB_MODE": "offline", "WANDB_DATA_DIR": str(tmp_path / "wb-data"),
            "WANDB_CACHE_DIR": str(tmp_path / "wb-cache"),
            "WANDB_CONFIG_DIR": str(tmp_path / "wb-config"), "WANDB_PROJECT": "",
            "MLFLOW_TRACKING_URI": "", "MLFLOW_EXPERIMENT_NAME": "", **more}


def wandb_runs(run_dir: Path) -> list[OfflineRun]:
    """Every offline W&B run under the run dir."""
    return [read_offline_run(folder) for folder in sorted((run_dir / "wandb").glob("offline-run-*"))]


def mlflow_client(uri: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's file store, as docs say
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def mlflow_runs(client: Any) -> list[Any]:
    experiments = [e.experiment_id for e in client.search_experiments()]
    return list(client.search_runs(experiments))


def columns(rows: list[dict[str, float]]) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv as (env steps, value) per column, finite values only (as the trackers get
    them)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if math.isfinite(value):
                out.setdefault(name, []).append((int(row["env_steps"]), value))
    return out


def test_wandb_offline_and_mlflow_file_store_get_the_config_every_row_the_summary_and_the_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_dir = tmp_path / "run"
    proc = run_app("loop.trackers=[wandb,mlflow,tensorboard]", *SMALL,
                   f"loop.total_env_steps={4 * PER_UPDATE}",
                   "loop.checkpoint_every=0", "loop.eval_every=2", "loop.eval_episodes=1",
                   "loop.eval_video=true", f"hydra.run.dir={run_dir}", env=offline(tmp_path),
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    rows = metrics(run_dir)
    steps = [int(r["env_steps"]) for r in rows]
    assert steps == [PER_UPDATE * u for u in (1, 2, 3, 4)], steps
    expected = columns(rows)
    assert {"mean_return", "pg_loss", "v_loss", "entropy", "env_steps_per_s"} <= set(expected)
    summary = read_result(run_dir)["summary"]
    # The closing summary names where each tracker wrote.
    assert summary["files"]["wandb"] == str(run_dir / "wandb"), summary["files"]
    assert summary["files"]["mlruns"] == str(run_dir / "mlruns"), summary["files"]

    # W&B: one run (rank 0's alone, on a layout of 4 ranks).
    (run,) = wandb_runs(run_dir)
    assert sorted(run.history) == steps
    for name, points in expected.items():
        assert [(s, run.history[s][name]) for s, _ in points] == [
            (s, pytest.approx(v, rel=1e-12)) for s, v in points], name
    assert run.config["layout"]["world_size"] == 4 and run.config["layout"]["trainers"] == [0, 1]
    assert run.config["loop"]["total_env_steps"] == 4 * PER_UPDATE
    assert run.config["loop"]["trackers"] == ["wandb", "mlflow", "tensorboard"]
    assert run.config["comm"]["backend"] == "gloo"
    assert run.summary["summary/env_steps"] == 4 * PER_UPDATE
    assert run.summary["summary/solved"] == 0
    assert run.summary["summary/final_mean_return"] == pytest.approx(summary["final_mean_return"])
    assert run.summary["summary/eval.return_mean"] == pytest.approx(summary["eval"]["return_mean"])
    assert {name: sorted(files) for name, files in run.artifacts.items()} == {
        f"outputs-{run.run_id}": ["learning_curve.png", "videos/best.mp4", "videos/last.mp4"]}
    assert run.exit_code == 0 and not run.resumable and run.project == "rlcomm"

    # MLflow: one run in the run dir's own file store.
    client = mlflow_client((run_dir / "mlruns").as_uri(), monkeypatch)
    (found,) = mlflow_runs(client)
    run_id = found.info.run_id
    assert found.info.status == "FINISHED" and found.info.run_name == "ppo CartPole-v1"
    assert client.get_experiment(found.info.experiment_id).name == "rlcomm"
    for name, points in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert history == [(s, pytest.approx(v, rel=1e-12)) for s, v in points], name
    params = found.data.params
    assert (params["layout.world_size"], params["loop.total_env_steps"], params["comm.backend"],
            params["loop.trackers"]) == ("4", str(4 * PER_UPDATE), "gloo",
                                         "['wandb', 'mlflow', 'tensorboard']")
    assert params["loop.hparams.lr"] == str(run.config["loop"]["hparams"]["lr"]), params
    figures = found.data.metrics
    assert figures["summary/env_steps"] == 4 * PER_UPDATE and figures["summary/solved"] == 0
    assert client.get_metric_history(run_id, "summary/env_steps")[0].step == 4 * PER_UPDATE
    shipped = {a.path for a in client.list_artifacts(run_id)} | {
        a.path for a in client.list_artifacts(run_id, "videos")}
    assert {"learning_curve.png", "videos/best.mp4", "videos/last.mp4"} <= shipped, shipped

    # TensorBoard: the config as a text, the summary's figures as scalars at the last step and
    # the learning curve as an image (every column: tests/e2e/test_run_view.py).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()
    assert "ppo/learning_curve" in tags["images"], tags
    assert "ppo/config/text_summary" in tags["tensors"], tags
    (solved,) = events.Scalars("ppo/summary/env_steps")
    assert (solved.step, solved.value) == (4 * PER_UPDATE, 4 * PER_UPDATE)
    assert [e.step for e in events.Scalars("ppo/pg_loss")] == steps

    # What a resume needs: each tracker's run and its last step.
    side = json.loads((run_dir / "trackers.json").read_text())
    assert side["wandb"]["id"] == run.run_id and side["mlflow"]["run_id"] == run_id
    assert side["wandb"]["last_step"] == side["mlflow"]["last_step"] == 4 * PER_UPDATE


def test_a_resumed_run_goes_on_with_its_tracker_runs_and_logs_no_step_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    # A store both runs reach (MLflow's own variable): the same MLflow run can go on.
    store = (tmp_path / "shared-mlruns").as_uri()
    env = offline(tmp_path, MLFLOW_TRACKING_URI=store)
    # Both named by loop.tracker_project: W&B's project, MLflow's experiment.
    trackers = ("loop.trackers=[wandb,mlflow]", "loop.tracker_project=resumes")
    proc = run_app(*trackers, *SMALL, f"loop.total_env_steps={4 * PER_UPDATE}",
                   "loop.checkpoint_every=2", f"hydra.run.dir={first}", env=env,
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    # From the checkpoint at update 2, while the trackers hold updates 1-4 (as after a run that
    # failed past its last checkpoint): updates 3 and 4 are trained again, not logged again.
    checkpoint = first / "checkpoints" / "ckpt_000002.pt"
    proc = run_app(*trackers, *SMALL, f"loop.total_env_steps={6 * PER_UPDATE}",
                   "loop.checkpoint_every=2", f"loop.resume={checkpoint}",
                   f"hydra.run.dir={resumed}", env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    retrained = [int(r["env_steps"]) for r in metrics(resumed)]
    assert retrained == [PER_UPDATE * u for u in (3, 4, 5, 6)], retrained

    # W&B: the same run id in both run dirs (`wandb sync` of both continues one run), the
    # second resumable and starting after the first's last step.
    (before,), (after,) = wandb_runs(first), wandb_runs(resumed)
    assert after.run_id == before.run_id and after.resumable
    assert before.project == after.project == "resumes"
    assert sorted(before.history) == [PER_UPDATE * u for u in (1, 2, 3, 4)]
    assert sorted(after.history) == [PER_UPDATE * u for u in (5, 6)]
    new_rows = {int(r["env_steps"]): r for r in metrics(resumed)}
    for step in (5 * PER_UPDATE, 6 * PER_UPDATE):
        assert after.history[step]["pg_loss"] == pytest.approx(new_rows[step]["pg_loss"])

    # MLflow: one run, every step once, finished; its parameters are the first attempt's.
    client = mlflow_client(store, monkeypatch)
    (found,) = mlflow_runs(client)
    assert client.get_experiment(found.info.experiment_id).name == "resumes"
    logged = [m.step for m in client.get_metric_history(found.info.run_id, "pg_loss")]
    assert sorted(logged) == [PER_UPDATE * u for u in range(1, 7)], logged
    assert found.info.status == "FINISHED"
    assert found.data.params["loop.total_env_steps"] == str(4 * PER_UPDATE)
    assert found.data.metrics["summary/env_steps"] == 6 * PER_UPDATE
    side = json.loads((resumed / "trackers.json").read_text())
    assert side["mlflow"]["run_id"] == found.info.run_id and side["wandb"]["id"] == after.run_id
    # The first run dir stays as it was: its own records, its own last step.
    assert json.loads((first / "trackers.json").read_text())["wandb"]["last_step"] == \
        4 * PER_UPDATE


def test_a_run_whose_rank_0_fails_marks_its_tracker_runs_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_dir = tmp_path / "run"
    # One rank that collects and trains; each of its envs raises at its 601st step, a few
    # updates in.
    proc = run_app("loop.trackers=[wandb,mlflow]", *SMALL, "layout=single",
                   "loop.checkpoint_every=0",
                   "loop.env._target_=tests.helpers.failing_env.make_failing_env",
                   "+loop.env.kwargs.fail_rank=0", "+loop.env.kwargs.after_steps=600",
                   f"hydra.run.dir={run_dir}", env=offline(tmp_path), timeout=TIMEOUT_S)
    assert proc.returncode == 2, describe(proc)
    assert "simulated fault after 600 steps" in proc.stderr.strip().splitlines()[-1]
    steps = [int(r["env_steps"]) for r in metrics(run_dir)]
    assert steps, describe(proc)
    (run,) = wandb_runs(run_dir)
    assert run.exit_code == 1 and sorted(run.history) == steps
    client = mlflow_client((run_dir / "mlruns").as_uri(), monkeypatch)
    (found,) = mlflow_runs(client)
    assert found.info.status == "FAILED"
    assert sorted(m.step for m in client.get_metric_history(found.info.run_id, "env_steps")) == \
        steps


@pytest.mark.parametrize(("tracker", "package"), [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_tracker_that_is_not_installed_is_one_line_and_exit_2_before_any_rank_starts(
    tracker: str, package: str, tmp_path: Path,
) -> None:
    # The app exactly as `python -m app`, in an interpreter where the package cannot be imported.
    blocked = (f"import sys, runpy; sys.modules[{package!r}] = None; "
               "sys.argv[0] = 'app'; runpy.run_module('app', run_name='__main__')")
    proc = run_app(f"loop.trackers=[{tracker}]", f"hydra.run.dir={tmp_path}", timeout=120,
                   module=(sys.executable, "-c", blocked), env=offline(tmp_path))
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines() == [
        f"error: loop.trackers: {tracker} needs the {package} package; "
        f"pip install -c constraints.txt -e '.[{tracker}]'"], describe(proc)
    assert not (tmp_path / "logs").exists()  # no rank ever started


def test_wandb_online_without_credentials_is_one_line_and_exit_2_before_any_rank_starts(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"  # no ~/.netrc, no W&B settings
    home.mkdir()
    env = {**offline(tmp_path), "WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(home),
           "NETRC": str(home / ".netrc")}
    proc = run_app("loop.trackers=[wandb]", f"hydra.run.dir={tmp_path / 'run'}", timeout=120,
                   env=env)
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines() == [
        "error: loop.trackers: wandb logs online (WANDB_MODE=online) and finds no credentials; "
        "run `wandb login`, set WANDB_API_KEY, or log offline with WANDB_MODE=offline"
    ], describe(proc)
    assert not (tmp_path / "run" / "logs").exists()
