"""``python -m app [overrides]``: compose, validate, plan, then launch or join the ranks."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from app.api import RankEnv
from app.config import register_configs
from app.config.help import help_text
from app.launch.environment import mark_job_start, output_subdir, resolve_rank_env, run_id
from app.launch.failures import recording_failures, write_errors_named
from app.launch.planning import check_restarts, check_world_size, validate
from app.launch.slurm import register_launcher_configs
from app.output.layout_picture import write_layout_files
from app.output.logs import quiet_file_errors
from app.output.summary import format_summary
from rlcomm import RlcommError, format_plan

log = logging.getLogger("app")

OmegaConf.register_new_resolver("rlcomm_run_id", run_id, replace=True)
OmegaConf.register_new_resolver("rlcomm_output_subdir", output_subdir, replace=True)
OmegaConf.register_new_resolver("rlcomm_help", help_text, replace=True)
register_configs()
register_launcher_configs()  # hydra/launcher=rlcomm_slurm|rlcomm_local


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """The whole job, testable without Hydra's decorator. A rank of a joined job that fails,
    even in validation, leaves its failure record for the launcher (app/launch/failures.py)."""
    env = resolve_rank_env()
    # A full disk, a read-only run dir: one line, not a traceback.
    with write_errors_named(f"rank {env.rank}: " if env.joins else ""):
        if not env.joins or cfg.plan_only:
            return _run(cfg, run_dir, env)
        with recording_failures(run_dir / "logs", env.rank, env.restart_count, env.node):
            return _run(cfg, run_dir, env)


def _run(cfg: DictConfig, run_dir: Path, env: RankEnv) -> dict[str, Any] | None:
    plan = validate(cfg)
    if cfg.plan_only:
        print(format_plan(plan))
        print(f"layout picture: {write_layout_files(plan, run_dir)}")
        return None
    if env.note and env.rank == 0:
        log.warning(env.note)
    if env.joins:
        check_world_size(plan, env.world_size, env.rank)  # before importing torch
        check_restarts(cfg.launcher.max_restarts, env.max_restarts)
    from rlcomm import resolve_backend

    resolve_backend(cfg.comm.backend)  # nccl without CUDA fails here, before any process
    if env.rank == 0:  # after the checks: every rank of a bad job fails alike, and at once
        write_layout_files(plan, run_dir)  # one picture per run, from one process
    config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    if not env.joins:
        from app.launch.local import launch_local

        log.info("starting %d local ranks; run dir %s", plan.world_size, run_dir)
        result: dict[str, Any] | None = launch_local(config, plan, run_dir)
    else:
        from app.launch.rank import run_rank

        result = run_rank(config, plan, str(run_dir))
    if result is not None:  # rank 0's summary (a joined job: on rank 0 only)
        print(format_summary(result["summary"]), flush=True)
    return result


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any] | None:
    mark_job_start()
    quiet_file_errors()  # Hydra's __main__.log on a full disk: one line, not a traceback each
    hydra_cfg = HydraConfig.get()
    try:
        return run(cfg, Path(hydra_cfg.runtime.output_dir))
    except RlcommError as err:
        # An interrupt (exit_code 128 + signal) ends a sweep too; other errors fail one job.
        exit_code = getattr(err, "exit_code", 2)
        if hydra_cfg.mode == RunMode.MULTIRUN and exit_code == 2:
            raise  # Hydra records the job as failed and runs the rest of the sweep
        print(f"error: {err}", file=sys.stderr)
        sys.exit(exit_code)


if __name__ == "__main__":
    main()
