"""The Hydra application's command line, run as a user would run it (``python -m app``,
torchrun, the console script): plans, runs, sweeps, plugged-in loops, --help, and the one line
a bad setting gets before any rank starts. What the config composes to, without a run, is
tests/unit/test_app_config.py."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest

from tests.helpers.apprun import (
    LAYOUTS,
    REPO,
    assert_commcheck_passed,
    describe,
    read_result,
    run_app,
)


@pytest.mark.e2e
def test_plan_only_prints_the_table_and_starts_nothing(tmp_path: Path) -> None:
    proc = run_app("plan_only=true", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    assert "WEIGHT_TRANSFER" in proc.stdout and "rollout" in proc.stdout
    assert not (tmp_path / "logs").exists()


@pytest.mark.e2e
def test_default_layout_runs_four_ranks_and_checks_every_group(tmp_path: Path) -> None:
    proc = run_app("loop=commcheck", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    result = read_result(tmp_path)
    assert_commcheck_passed(result, 4)
    assert sorted(p.name for p in (tmp_path / "logs").glob("rank*.log")) == [
        f"rank{r}.log" for r in range(4)
    ]
    assert "[rank0]" in proc.stderr
    # A loop without figures of its own still ends with the closing summary: who, how long, where.
    summary = result["summary"]
    assert summary["loop"] == "app.loops.commcheck.CommCheck" and summary["restarts"] == 0
    assert proc.stdout.splitlines()[-4:] == [
        f"app.loops.commcheck.CommCheck finished on 4 ranks in {summary['wall_s']:.1f} s, 0 restarts",
        f"logs         {tmp_path / 'logs'}",
        f"result.json  {tmp_path / 'result.json'}",
        "-" * 72,
    ], describe(proc)
    wt = {r["rank"]: r["groups"]["WEIGHT_TRANSFER"]["ranks"] for r in result["ranks"]}
    assert wt == {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["2x2", "tp2dp2"])
def test_other_layouts_with_overrides(layout: str, tmp_path: Path) -> None:
    proc = run_app(f"layout={layout}", "loop=commcheck", "comm.timeout=60",
                   "loop.bandwidth_bytes=65536", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    result = read_result(tmp_path)
    assert_commcheck_passed(result, 4)
    modes = set(result["ranks"][0]["groups"])
    if layout == "tp2dp2":
        assert {"TENSOR_PARALLEL", "DATA_PARALLEL"} <= modes
    else:
        assert result["ranks"][3]["groups"]["INTRA_NODE"]["ranks"] == [2, 3]


@pytest.mark.e2e
def test_multirun_over_three_layouts_leaves_one_result_per_job(tmp_path: Path) -> None:
    proc = run_app("--multirun", "layout=1t1r,2t2r,1t3r", "loop=commcheck",
                   "loop.bandwidth_bytes=65536", f"hydra.sweep.dir={tmp_path}", timeout=600)
    assert proc.returncode == 0, describe(proc)
    for job, world in enumerate([2, 4, 4]):
        assert_commcheck_passed(read_result(tmp_path / str(job)), world)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [j["status"] for j in summary["jobs"]] == ["ok", "ok", "ok"]
    # Ranked by commcheck's default: the slowest group's latency, lowest first.
    assert summary["rank_by"] == "max_latency_us"
    best = summary["ranking"][0]["median"]
    assert best == min(j["metrics"]["max_latency_us"] for j in summary["jobs"])
    first = read_result(tmp_path / "0")
    assert "latency_us:WEIGHT_TRANSFER[0,1]" in first["metrics"]
    assert first["ranks"][0]["result"]["slowest_group"] in {
        key.split(":", 1)[1] for key in first["metrics"] if key.startswith("latency_us:")
    }


@pytest.mark.e2e
def test_a_failing_sweep_job_does_not_hide_the_others(tmp_path: Path) -> None:
    # Job 0 passes validation, then fails as it runs: its rollout rank's env raises at its first
    # step (a job whose config is bad ends the sweep before any job: test_sweep_validation.py).
    proc = run_app("--multirun", "layout=1t1r", "loop.progress=false", "loop.hparams.num_envs=4",
                   "loop.hparams.num_steps=32", "loop.total_env_steps=256",
                   "loop.env._target_=tests.helpers.failing_env.make_failing_env",
                   "+loop.env.kwargs.fail_rank=1,-1", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode != 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [j["status"] for j in summary["jobs"]] == ["failed", "ok"]
    # The cause is rank 1's own error, whether or not rank 0 noticed the loss first.
    error = summary["jobs"][0]["error"]
    assert error.startswith("rank 1 exit code 1: EnvError: ") and "simulated fault" in error, error
    assert read_result(tmp_path / "1")["world_size"] == 2


@pytest.mark.e2e
def test_torchrun_join_mode_uses_one_run_dir(tmp_path: Path) -> None:
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "4", "-m", "app")
    # Without hydra.run.dir every rank resolves the run dir itself: they must agree.
    proc = run_app("loop=commcheck", "loop.bandwidth_bytes=65536", cwd=tmp_path, module=torchrun,
                   env={"PYTHONPATH": str(REPO)}, timeout=180)
    assert proc.returncode == 0, describe(proc)
    run_dirs = [p.parent for p in tmp_path.glob("outputs/runs/*/result.json")]
    assert len(run_dirs) == 1, list(tmp_path.rglob("*"))
    assert_commcheck_passed(read_result(run_dirs[0]), 4)
    assert len(list(run_dirs[0].glob("logs/rank*.log"))) == 4
    assert len(list(tmp_path.glob("outputs/runs/*"))) == 1


@pytest.mark.e2e
def test_launcher_max_restarts_must_agree_with_torchrun(tmp_path: Path) -> None:
    """Under torchrun its agent restarts the ranks: a launcher.max_restarts other than its
    --max-restarts is a one-line error on every rank, before any group exists."""
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "--max-restarts", "1", "-m", "app")
    proc = run_app("layout=1t1r", "loop=commcheck", "launcher.max_restarts=2", cwd=tmp_path,
                   module=torchrun, env={"PYTHONPATH": str(REPO)}, timeout=180)
    line = ("error: launcher.max_restarts: 2, but torchrun restarts these ranks and was "
            "started with --max-restarts 1; pass --max-restarts 2 to torchrun instead")
    # Both attempts (the first and torchrun's one restart) fail alike. In each, the first rank
    # to fail prints the line; torchrun's agent may stop the other before it prints its own.
    # Two ranks share the one stderr pipe, so their lines are counted, not split apart.
    errors = proc.stderr.count("error:")
    assert proc.stderr.count(line) == errors, describe(proc)
    assert 2 <= errors <= 4, describe(proc)
    assert proc.returncode != 0
    assert not list(tmp_path.glob("outputs/runs/*/result.json"))


USER_LOOP = '''
from dataclasses import dataclass

import torch

from app.config import setting
from rlcomm import collectives


@dataclass
class CountRanks:
    scale: int = setting(1, "what each rank adds")

    def __call__(self, ctx, job):
        total = collectives.all_reduce(ctx, "GLOBAL", torch.tensor([self.scale]))
        return {"total": int(total.item()), "role": job.plan.role(job.rank)}
'''

# Hydra imports every module under hydra_plugins/ before composing: a user's package registers
# its loop's schema there, as app/config/ registers the shipped ones.
USER_PLUGIN = """
from app.config import register_loop
from mypkg.loops import CountRanks

register_loop("count", CountRanks)
"""


def _user_package(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "loops.py").write_text(textwrap.dedent(USER_LOOP))
    return {"PYTHONPATH": f"{REPO}:{tmp_path}"}


@pytest.mark.e2e
def test_user_loop_plugged_from_outside_the_repo(tmp_path: Path) -> None:
    env = _user_package(tmp_path)
    conf = tmp_path / "myconf" / "loop"
    conf.mkdir(parents=True)
    (conf / "count.yaml").write_text("_target_: mypkg.loops.CountRanks\nscale: 3\n")

    by_target = tmp_path / "by_target"
    proc = run_app("layout=1t1r", "loop=custom", "loop._target_=mypkg.loops.CountRanks",
                   "+loop.scale=2", f"hydra.run.dir={by_target}", env=env, cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert [r["result"]["total"] for r in read_result(by_target)["ranks"]] == [4, 4]

    by_file = tmp_path / "by_file"
    proc = run_app("layout=1t3r", "loop=count", f"hydra.searchpath=[file://{tmp_path / 'myconf'}]",
                   f"hydra.run.dir={by_file}", env=env, cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    ranks = read_result(by_file)["ranks"]
    assert [r["result"] for r in ranks] == [{"total": 12, "role": "trainer"}] + [
        {"total": 12, "role": "rollout"}
    ] * 3


@pytest.mark.e2e
def test_a_user_loop_is_type_checked_against_its_dataclass(tmp_path: Path) -> None:
    env = _user_package(tmp_path)
    conf = tmp_path / "myconf" / "loop"
    conf.mkdir(parents=True)
    (conf / "count.yaml").write_text("_target_: mypkg.loops.CountRanks\nscal: 3\n")  # a typo
    proc = run_app("loop=count", f"hydra.searchpath=[file://{tmp_path / 'myconf'}]",
                   f"hydra.run.dir={tmp_path / 'run'}", env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: loop.scal: not a setting of mypkg.loops.CountRanks"
    )
    proc = run_app("loop=custom", "loop._target_=mypkg.loops.CountRanks", "+loop.scale=abc",
                   f"hydra.run.dir={tmp_path / 'run'}", env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: loop.scale: Value 'abc'")
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.e2e
def test_a_user_loop_registers_its_schema_like_the_shipped_ones(tmp_path: Path) -> None:
    env = _user_package(tmp_path)
    plugin = tmp_path / "hydra_plugins" / "mypkg_loops"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text(USER_PLUGIN)
    conf = tmp_path / "myconf" / "loop"
    conf.mkdir(parents=True)
    (conf / "count.yaml").write_text("defaults: [count_schema, _self_]\nscale: 3\n")
    args = ("loop=count", f"hydra.searchpath=[file://{tmp_path / 'myconf'}]")
    proc = run_app(*args, "--help", env=env, cwd=tmp_path)
    assert proc.returncode == 0, describe(proc)
    assert "loop.scale: int = 3  # what each rank adds" in proc.stdout
    assert "count*" in proc.stdout and "count_schema" not in proc.stdout
    proc = run_app(*args, "loop.scale=abc", env=env, cwd=tmp_path)  # Hydra rejects it
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: loop.scale: Value 'abc' of type 'str' could not be converted to Integer")


@pytest.mark.e2e
def test_help_lists_groups_and_every_setting_with_its_doc() -> None:
    proc = run_app("--help")
    assert proc.returncode == 0, describe(proc)
    out = proc.stdout
    layouts = ", ".join(f"{n}*" if n == "2t2r" else n for n in LAYOUTS)
    assert f"layout:         {layouts}" in out
    assert "_schema" not in out  # schema entries are not options to pick
    assert "comm.timeout: float = 300.0  # seconds; bounds the rendezvous, init and every group" in out
    assert "loop.hparams.gamma: float = 0.99  # discount factor, in (0, 1]" in out
    from app.config import AppConfig, CommConfig, LauncherConfig, LayoutConfig
    from app.config.schema import RayConfig
    from app.loops.ppo import PPOLoop
    from app.loops.ppo.core import PPOSettings
    from app.runtime.envs.vector import EnvConfig

    for prefix, schema in [("comm", CommConfig), ("layout", LayoutConfig),
                           ("launcher", LauncherConfig), ("launcher.ray", RayConfig),
                           ("loop", PPOLoop),
                           ("loop.hparams", PPOSettings), ("loop.env", EnvConfig)]:
        for f in fields(schema):
            if f.name not in ("hparams", "env", "model", "ray"):  # nested: listed by their own fields
                assert f.metadata["doc"], f"{prefix}.{f.name} has no doc"
                assert f"  {prefix}.{f.name}: " in out
    assert all(f.metadata["doc"] for f in fields(AppConfig))
    proc = run_app("loop=commcheck", "layout=1t3r", "--help")  # the composed values
    assert "loop.latency_iters: int = 20" in proc.stdout and "layout.rollouts: list[int] = [1,2,3]" in proc.stdout


@pytest.mark.e2e
def test_a_bad_override_is_one_line_and_exit_2_before_any_rank_starts(tmp_path: Path) -> None:
    proc = run_app("layout.rollouts=[2,9]", "loop=commcheck", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: layout.rollouts: rank 9 in group [2,9] is out of range for world_size 4"
    )
    assert not (tmp_path / "logs").exists()  # no rank ever started
    proc = run_app("loop.hparams.num_envs=abc", f"hydra.run.dir={tmp_path}")  # Hydra's own check
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines() == [
        "error: loop.hparams.num_envs: Value 'abc' of type 'str' could not be converted to Integer"]
    proc = run_app("launcher.engine=kubernetes", f"hydra.run.dir={tmp_path}")  # an Enum's values
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines() == [
        "error: launcher.engine: Invalid value 'kubernetes', expected one of [local, ray]"]
    assert not (tmp_path / "logs").exists()


@pytest.mark.e2e
def test_nccl_without_cuda_fails_before_any_rank_starts(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error is for machines without it")
    proc = run_app("comm=nccl", "loop=commcheck", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: backend 'nccl' needs CUDA devices but none are visible on this machine; "
        "use backend='gloo' (or 'auto')"
    )
    assert not (tmp_path / "logs").exists()
    shutil.rmtree(tmp_path)


@pytest.mark.e2e
def test_installed_console_script_works_from_any_directory(tmp_path: Path) -> None:
    script = shutil.which("rlcomm-run")
    assert script, "rlcomm-run is not on PATH: install the package (pip install -e .)"
    proc = run_app("plan_only=true", "layout=1t3r", module=(script,), cwd=tmp_path,
                   env={"PYTHONPATH": ""})
    assert proc.returncode == 0, describe(proc)
    assert "rollout" in proc.stdout and (tmp_path / "outputs" / "runs").is_dir()


# ---- layouts by count and ranges (one layout declaration: rlcomm's LayoutSpec) -------------


@pytest.mark.e2e
def test_a_65536_rank_layout_is_one_command_line(tmp_path: Path) -> None:
    proc = run_app("plan_only=true", "loop=commcheck", "layout.world_size=65536",
                   "layout.trainers=1", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    out = proc.stdout
    assert out.startswith("world_size=65536 nodes=1 ranks_per_node=65536 |")
    assert "WEIGHT_TRANSFER: 1 group(s)" in out and "... 65472 more ranks" in out
    assert [line.split()[2] for line in out.splitlines()[3:5]] == ["trainer", "rollout"]
    # Under the table: the layout, and whose choice it was (fields overridden on top of it).
    assert "\nlayout: 2t2r (the app's default; layout=... to choose another)\n" in out, out[-500:]
    assert (tmp_path / "layout.png").is_file() and not (tmp_path / "logs").exists()


@pytest.mark.e2e
def test_ranges_on_the_command_line_with_the_rest_as_rollouts(tmp_path: Path) -> None:
    proc = run_app("plan_only=true", "loop=commcheck", "layout.world_size=6",
                   'layout.trainers="0-1,4"', f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, describe(proc)
    rows = [line.split() for line in proc.stdout.splitlines()[3:9]]
    assert [row[2] for row in rows] == ["trainer", "trainer", "rollout", "rollout", "trainer",
                                        "rollout"]
    assert [row[-1] for row in rows][:2] == ["[0,2]", "[1,3]"]  # WEIGHT_TRANSFER: 0->2, 1->3


@pytest.mark.e2e
def test_a_bad_range_is_one_line_and_exit_2_before_any_rank_starts(tmp_path: Path) -> None:
    proc = run_app("loop=commcheck", "layout.trainers=3-1", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, describe(proc)
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: layout.trainers: range '3-1' runs backwards; write 1-3"
    )
    assert not (tmp_path / "logs").exists()


@pytest.mark.e2e
def test_help_documents_the_count_and_range_forms() -> None:
    proc = run_app("layout.trainers=1", "--help")
    assert proc.returncode == 0, describe(proc)
    assert ('layout.trainers: list[int] = 1  # ranks that train (DDP over TRAIN_DATA_PARALLEL): '
            '[0,1], a count 2 (the first 2 ranks) or ranges "0-3,8"') in proc.stdout
    assert "layout.rollouts: list[int] = null  # " in proc.stdout
