"""The Launcher contract (app/launch/launcher.py): which launcher claims a process, picked once."""

from __future__ import annotations

import importlib
import inspect
import os

import pytest

from app.api import RankEnv
from app.launch.launcher import LAUNCHERS, Launcher, launcher_for

pytestmark = pytest.mark.unit

_TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "1", "WORLD_SIZE": "2"}
_SRUN = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
_SUBMITIT_LOCAL = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "1",
                   "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_ID": "123"}


@pytest.mark.parametrize(("environ", "name"), [
    ({}, "local"),
    (_TORCHRUN, "joined"),
    (_SRUN, "joined"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "joined"),
    ({**_SRUN, "SUBMITIT_EXECUTOR": "slurm"}, "submitit"),
    (_SUBMITIT_LOCAL, "submitit"),
    # One srun task is no rank: the app launches the layout's ranks itself there.
    ({**_SRUN, "SLURM_NTASKS": "1", "SUBMITIT_EXECUTOR": "slurm"}, "local"),
])
def test_one_launcher_claims_each_way_a_process_is_started(
    environ: dict[str, str], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _started_with(environ, monkeypatch)
    launcher = launcher_for(env)
    assert launcher.name == name
    assert launcher.starts_ranks == (not env.joins)
    claiming = [n for n in LAUNCHERS if _load(n).claims(env, "local")]
    assert claiming[0].endswith(type(launcher).__name__)


@pytest.mark.parametrize(("environ", "name"), [
    ({}, "ray"),  # python -m app launcher.engine=ray: the driver of a Ray job
    (_TORCHRUN, "joined"),  # a rank already: the engine is the launching process's choice
    (_SRUN, "joined"),
    ({"RLCOMM_ENGINE": "ray", "RANK": "1", "WORLD_SIZE": "4"}, "joined"),  # a Ray engine's rank
])
def test_launcher_engine_ray_picks_the_ray_engine_where_this_process_starts_the_ranks(
    environ: dict[str, str], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.config.schema import Engine

    env = _started_with(environ, monkeypatch)
    assert launcher_for(env, Engine.ray).name == name
    assert launcher_for(env, "ray").name == name
    if "RLCOMM_ENGINE" in environ:
        assert env.launcher == "ray" and env.rank == 1 and env.world_size == 4


def test_every_launcher_keeps_the_contract() -> None:
    members = {name for name in dir(Launcher) if not name.startswith("_")}
    members |= set(Launcher.__annotations__)
    for name in LAUNCHERS:
        launcher = _load(name)
        missing = {m for m in members if not hasattr(launcher, m)}
        assert not missing, f"{name} lacks {missing}"
        launch = inspect.signature(type(launcher).launch).parameters
        assert list(launch) == [*inspect.signature(Launcher.launch).parameters], name
        assert list(launch) == ["self", "job", "plan", "run_dir"], name
        assert launcher.__doc__, f"{name}: say what this launcher is in its docstring"


def test_the_local_launcher_is_asked_last() -> None:
    # A rank of a joined run stops at the joined launcher: torch's elastic agent, which the
    # local launcher's module imports, is not imported into it.
    assert launcher_for(RankEnv("torchrun", rank=1, world_size=2)).name == "joined"
    assert LAUNCHERS[-1] == "app.launch.local:LocalLauncher"


def _started_with(environ: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> RankEnv:
    """This process's RankEnv as if started with ``environ`` and no other launcher variable."""
    from app.launch.environment import is_launcher_variable, resolve_rank_env

    for variable in [v for v in os.environ if is_launcher_variable(v)]:
        monkeypatch.delenv(variable)
    for variable, value in environ.items():
        monkeypatch.setenv(variable, value)
    return resolve_rank_env()


def _load(name: str) -> Launcher:
    module, _, cls = name.partition(":")
    launcher: Launcher = getattr(importlib.import_module(module), cls)()
    return launcher
