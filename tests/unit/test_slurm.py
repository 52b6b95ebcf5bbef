"""SLURM without a cluster, in this process: which SLURM or submitit task is a rank
(app/launch/environment.py), its master port, node lists and task counts, and the launcher
presets' shape per layout. The app on a real SLURM cluster is tests/cluster/test_slurm.py."""

from __future__ import annotations

import os

import pytest

from tests.helpers.apprun import REPO

pytestmark = pytest.mark.unit


STEP_ENV = {"SLURM_JOB_ID": "26", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "4",
            "SLURM_STEP_NODELIST": "vm", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_NAME": "interactive"}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    from app.launch.environment import is_launcher_variable

    for name in list(os.environ):
        if is_launcher_variable(name):
            monkeypatch.delenv(name)
    return monkeypatch


def test_an_srun_task_is_a_rank_even_under_salloc(clean_env: pytest.MonkeyPatch) -> None:
    from app.launch.environment import resolve_rank_env, run_id

    for name, value in STEP_ENV.items():
        clean_env.setenv(name, value)
    env = resolve_rank_env()
    assert (env.launcher, env.rank, env.world_size) == ("slurm", 1, 4)
    assert env.torch_variables() == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                     "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "vm",
                                     "MASTER_PORT": "15208"}
    assert run_id() == "slurm-26.0"
    clean_env.setenv("SLURM_ARRAY_JOB_ID", "25")
    clean_env.setenv("SLURM_ARRAY_TASK_ID", "1")
    assert run_id() == "slurm-25_1.0"


def test_the_batch_script_and_one_task_steps_launch_ranks_themselves(
    clean_env: pytest.MonkeyPatch,
) -> None:
    from app.launch.environment import resolve_rank_env

    # what sbatch sets in the batch script itself: SLURM_PROCID and SLURM_NTASKS, no step
    for name in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST"):
        clean_env.setenv(name, STEP_ENV[name])
    env = resolve_rank_env()
    assert env.launcher == "local" and env.note and "srun" in env.note
    clean_env.setenv("SLURM_STEP_ID", "4294967291")  # the batch step's id in 22.05
    assert resolve_rank_env().launcher == "local"
    clean_env.setenv("SLURM_STEP_ID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")  # srun --pty bash, srun -n1 python -m app
    env = resolve_rank_env()
    assert (env.launcher, env.note, env.torch_variables()) == ("local", None, {})


def test_a_submitit_local_task_is_a_rank(clean_env: pytest.MonkeyPatch) -> None:
    from app.launch.environment import master_port, resolve_rank_env

    for name, value in {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "2",
                        "SUBMITIT_LOCAL_LOCALID": "2", "SUBMITIT_LOCAL_NTASKS": "4",
                        "SUBMITIT_LOCAL_JOB_ID": "7144"}.items():
        clean_env.setenv(name, value)
    env = resolve_rank_env()
    assert (env.launcher, env.rank, env.world_size) == ("submitit", 2, 4)
    variables = env.torch_variables()
    assert variables["MASTER_ADDR"] == "127.0.0.1"
    assert variables["MASTER_PORT"] == str(master_port(7144))


def test_master_ports_differ_between_nearby_jobs_and_steps() -> None:
    from app.launch.environment import master_port

    ports = {master_port(job, step) for job in range(1000, 3000) for step in range(8)}
    assert len(ports) == 2000 * 8
    assert all(15000 <= p < 32768 for p in ports)  # below the ephemeral range


def test_node_lists_and_task_counts_parse() -> None:
    from app.launch.environment import first_host, tasks_on_node

    assert first_host("gpu[003-004,010],cpu01") == "gpu003"
    assert [tasks_on_node("2(x3),1", n) for n in range(5)] == [2, 2, 2, 1, None]


def test_launcher_shape_follows_the_layout() -> None:
    from hydra import compose, initialize_config_dir

    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    shapes = {}
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for layout in ("single", "1t1r", "2t2r", "2x2"):
            for preset in ("rlcomm_slurm", "rlcomm_local"):
                cfg = compose("config", overrides=[f"hydra/launcher={preset}", f"layout={layout}"],
                              return_hydra_config=True)
                launcher = cfg.hydra.launcher
                shapes[layout, preset] = (launcher.nodes, launcher.tasks_per_node)
        assert cfg.hydra.launcher.get("srun_args") is None  # rlcomm_local
        cfg = compose("config", overrides=["hydra/launcher=rlcomm_slurm"], return_hydra_config=True)
        assert cfg.hydra.launcher.srun_args == ["--kill-on-bad-exit=1"]
        assert cfg.hydra.launcher.mem_gb == 16 and cfg.hydra.launcher.timeout_min >= 5
    assert shapes == {
        ("single", "rlcomm_slurm"): (1, 1), ("single", "rlcomm_local"): (1, 1),
        ("1t1r", "rlcomm_slurm"): (1, 2), ("1t1r", "rlcomm_local"): (1, 2),
        ("2t2r", "rlcomm_slurm"): (1, 4), ("2t2r", "rlcomm_local"): (1, 4),
        ("2x2", "rlcomm_slurm"): (2, 2), ("2x2", "rlcomm_local"): (1, 4),
    }
