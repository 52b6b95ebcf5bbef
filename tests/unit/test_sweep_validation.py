"""The SLURM launcher validates every sweep job before it submits any (no cluster needed: the
refusal comes before submitit is asked for anything). The local runs: tests/e2e/test_sweep_validation.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import HydraContext

from tests.helpers.apprun import REPO
from tests.helpers.counting_env import constructions

pytestmark = pytest.mark.unit


def test_the_slurm_launcher_refuses_a_sweep_with_a_bad_job_before_submitting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)
    from app.hydra.sweep_jobs import job_problem
    from hydra_plugins.rlcomm_launcher import RlcommSlurmLauncher

    sweep = tmp_path / "sweep"
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=rlcomm_slurm",
                                           f"hydra.sweep.dir={sweep}"], return_hydra_config=True)
        context = HydraContext(config_loader=GlobalHydra.instance().config_loader(),
                               callbacks=None)  # type: ignore[arg-type]  (the launcher calls none)
        good, bad = ["layout=1t1r", "seed=3"], ["layout=2t2r", "layout.trainers=[0,1,2,5]"]
        assert job_problem(context, cfg, good, ranks_here=False) is None
        assert job_problem(context, cfg, bad, ranks_here=False)  # else it would be submitted
        typo = job_problem(context, cfg, ["seed=abc"], ranks_here=False)  # composition fails
        assert typo is not None and "seed=abc" in typo and "\n" not in typo, typo
        params = {k: v for k, v in cfg.hydra.launcher.items() if k != "_target_"}
        launcher = RlcommSlurmLauncher(**params)
        launcher.setup(hydra_context=context, task_function=lambda c: None, config=cfg)
        with pytest.raises(SystemExit) as ended:
            launcher.launch([good, bad], initial_job_idx=0)
    assert ended.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: sweep job #1 (layout=2t2r layout.trainers=[0,1,2,5]): "
                           "layout."), line
    assert "\n" not in line and "5" in line
    assert not (sweep / ".submitit").exists()  # nothing submitted


def test_the_slurm_launcher_leaves_building_the_env_to_the_job(tmp_path: Path) -> None:
    """The submitting host checks what builds nothing; the local launchers build the env once."""
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)
    from app.hydra.sweep_jobs import job_problem

    counts = tmp_path / "counts"
    counts.mkdir()
    job = ["loop.env._target_=tests.helpers.counting_env.make_counting_env",
           f"+loop.env.kwargs.count_dir={counts}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                      return_hydra_config=True)
        context = HydraContext(config_loader=GlobalHydra.instance().config_loader(),
                               callbacks=None)  # type: ignore[arg-type]
        assert job_problem(context, cfg, job, ranks_here=False) is None
        assert constructions(counts) == {}
        assert job_problem(context, cfg, job, ranks_here=True) is None
        assert constructions(counts) == {"launcher": 1}
        # A factory that is not there fails on the submitting host too (no env built for it).
        missing = job_problem(context, cfg, ["loop.env._target_=nosuch.make"], ranks_here=False)
    assert missing is not None and missing.startswith("loop.env._target_: cannot import")
