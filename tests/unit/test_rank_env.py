"""RankEnv: who a process is, resolved once from the launcher's variables."""

from __future__ import annotations

import socket

import pytest

from app.api import RankEnv
from app.launch.environment import (
    LAUNCHER_VARIABLES,
    is_launcher_variable,
    launched_by,
    resolve_rank_env,
    without_launcher_variables,
)

pytestmark = pytest.mark.unit


def test_a_plain_shell_launches_the_ranks_itself() -> None:
    env = resolve_rank_env({"PATH": "/bin"})
    assert env == RankEnv("local", node=socket.gethostname())
    assert not env.joins and env.torch_variables() == {}


def test_a_torchrun_worker_is_a_rank_with_its_restart_count() -> None:
    env = resolve_rank_env({
        "TORCHELASTIC_RUN_ID": "abc", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "host1", "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "2",
    })
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == (
        "torchrun", 3, 4, 1, 2)
    assert (env.master_addr, env.master_port, env.restart_count) == ("host1", 29500, 2)
    assert env.run_name == "torchrun-abc" and env.joins


def test_torchrun_restarts_across_hosts_say_how_a_restarted_host_can_rejoin() -> None:
    worker = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
              "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "host1", "MASTER_PORT": "29500",
              "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    env = resolve_rank_env(worker)
    assert env.max_restarts == 1
    assert env.note and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in env.note
    # Set already (no shared agent store), one host, or no restarts: nothing to say.
    for change in ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, {"LOCAL_WORLD_SIZE": "4"},
                   {"TORCHELASTIC_MAX_RESTARTS": "0"}):
        assert resolve_rank_env({**worker, **change}).note is None, change


def test_ranks_started_by_hand_and_run_names() -> None:
    env = resolve_rank_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": "1234"})
    assert (env.launcher, env.rank, env.local_rank, env.local_world_size) == ("env", 1, 1, 2)
    assert env.run_name == "join-127.0.0.1-1234"
    assert env.torch_variables() == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                     "MASTER_PORT": "1234"}
    named = resolve_rank_env({"RANK": "0", "WORLD_SIZE": "2", "RLCOMM_RUN_ID": "mine"})
    assert named.run_name == "mine"


@pytest.mark.parametrize("name", ["RANK", "MASTER_PORT", "SLURM_PROCID", "TORCHELASTIC_RUN_ID",
                                  "SUBMITIT_EXECUTOR", "RLCOMM_RUN_ID", "GLOO_SOCKET_IFNAME",
                                  "NCCL_SOCKET_IFNAME"])
def test_one_list_of_launcher_variables(name: str) -> None:
    assert is_launcher_variable(name)
    assert without_launcher_variables({name: "1", "HOME": "/root"}) == {"HOME": "/root"}
    assert not is_launcher_variable("PYTHONPATH") and "PYTHONPATH" not in LAUNCHER_VARIABLES


@pytest.mark.unit
@pytest.mark.parametrize(("env", "launcher"), [
    ({}, "local"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2"}, "torchrun"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
     "slurm"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
     "local"),  # srun -n1 python -m app
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "local"),  # batch script
    ({"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NTASKS": "2",
      "SUBMITIT_LOCAL_JOB_ID": "9"}, "submitit"),
    ({"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_NTASKS": "1",
      "SUBMITIT_LOCAL_JOB_ID": "9"}, "local"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "env"),
])
def test_who_launched_this_process_is_told_alike_before_and_after_the_apps_imports(
    env: dict[str, str], launcher: str
) -> None:
    # launched_by decides whether python -m app starts a forkserver before its own imports.
    assert launched_by(env) == resolve_rank_env(env).launcher == launcher


def test_the_benchmarks_time_the_app_in_a_users_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.procs import users_environment

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # this machine's own setting
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MY_SETTING", "kept")
    env = users_environment()
    assert "PYTHONDONTWRITEBYTECODE" not in env and "RANK" not in env, sorted(env)
    assert env["MY_SETTING"] == "kept"
