"""``python -m app [overrides]``: compose, validate, plan, then launch or join the ranks."""

# ruff: noqa: E402  (the forkserver starts before this process's own imports)
from __future__ import annotations

import torch  # noqa: F401  (the launcher needs it: the loops' schemas; see below)

from app.launch.forkserver import start_early

# First: the ranks' forkserver, a fork of this process that keeps its torch and imports
# gymnasium, Hydra and the app on another core while this process composes and validates
# (app/launch/forkserver.py).
start_early()

import atexit
import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from app.api import RankEnv
from app.config import register_configs
from app.config.help import help_text
from app.config.provenance import job_choice
from app.errors import LaunchInterruptedError, say_error
from app.hydra.submitit import register_launcher_configs
from app.launch import forkserver
from app.launch.environment import mark_job_start, output_subdir, resolve_rank_env, run_id
from app.launch.failures import recording_failures, write_errors_named
from app.launch.launcher import launcher_for
from app.launch.planning import check_restarts, check_world_size, validate_job
from app.launch.private import one_line_override_errors
from app.output import timeline
from app.output.layout_picture import (
    describe_layout,
    draw_layout_file,
    write_layout_files,
    write_layout_text,
)
from app.output.logs import quiet_file_errors
from app.output.pictures import PictureService
from app.output.summary import format_summary
from rlcomm import LayoutPlan, RlcommError, format_plan

log = logging.getLogger("app")

OmegaConf.register_new_resolver("rlcomm_run_id", run_id, replace=True)
OmegaConf.register_new_resolver("rlcomm_output_subdir", output_subdir, replace=True)
OmegaConf.register_new_resolver("rlcomm_help", help_text, replace=True)
register_configs()
register_launcher_configs()  # hydra/launcher=rlcomm_slurm|rlcomm_local
one_line_override_errors()  # loop.nosuch=1: one line, exit 2 (app/launch/private.py)

_first_job = True  # the first job of this process starts at the process's start
PICTURE_AFTER_FAILURE_S = 5.0  # a failed run still waits this long for its layout picture


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
    # A rank of a joined run other than rank 0 builds no env to learn its spaces: rank 0 probes
    # it once and hands its spaces to every rank (app/launch/rank.py).
    plan, job = validate_job(cfg, probe=not env.joins or env.rank == 0)
    layout = job_choice("layout") if env.rank == 0 else None  # which, and whose choice
    if cfg.plan_only:
        _show_plan(plan, run_dir, layout)
        return None
    if layout is not None:
        log.info(layout.line())
    if env.note and env.rank == 0:
        log.warning(env.note)
    if env.joins:
        check_world_size(plan, env.world_size, env.rank)  # before importing torch
        check_restarts(cfg.launcher.max_restarts, env.max_restarts)
    from rlcomm import resolve_backend

    resolve_backend(cfg.comm.backend)  # nccl without CUDA fails here, before any process
    # The one place a launcher is picked (app/launch/launcher.py). The local one imports torch's
    # elastic agent here, while the forkserver still imports.
    launcher = launcher_for(env, cfg.launcher.engine)
    timeline.mark("validated")
    timeline.export()  # for the ranks (app/output/timeline.py)
    result = _launch(launcher, job, plan, run_dir, env)
    if result is not None:  # rank 0's summary (a joined job: on rank 0 only)
        print(format_summary(result["summary"]), flush=True)
    return result


def _show_plan(plan: LayoutPlan, run_dir: Path, layout: Any) -> None:
    """``plan_only``: every rank's groups and the layout picture, starting nothing."""
    picture = _draw_layout(plan, run_dir, nice=0)  # what the user asked for: not niced
    print(format_plan(plan))  # while the picture is drawn
    if layout is not None:
        print(layout.line())
    print(f"layout picture: {picture.wait() if picture else write_layout_files(plan, run_dir)}")


def _launch(launcher: Any, job: Any, plan: LayoutPlan, run_dir: Path,
            env: RankEnv) -> dict[str, Any] | None:
    """The ranks launched (or joined), with one layout picture per run, from one process,
    drawn beside the ranks' start; rank 0's summary, if this process has it."""
    picture = _draw_layout(plan, run_dir, serve=launcher.starts_ranks) if env.rank == 0 else None
    if picture is None and env.rank == 0:
        write_layout_files(plan, run_dir)
    try:
        # Ranks a launcher starts find its picture service through their environment.
        served = picture.environ() if isinstance(picture, PictureService) else {}
        with _environment(served):
            result: dict[str, Any] | None = launcher.launch(job, plan, run_dir)
        if picture is not None:  # written before the run reports success
            picture.wait()
            picture = None
    except (KeyboardInterrupt, LaunchInterruptedError):
        if picture is not None:  # stopped by the user: at once
            picture.cancel()
            picture = None
        raise
    finally:
        if picture is not None:  # the run failed: the picture is finished if it soon can be
            with contextlib.suppress(Exception):
                picture.wait(PICTURE_AFTER_FAILURE_S)
            picture.cancel()
    return result


def _draw_layout(plan: LayoutPlan, run_dir: Path, serve: bool = False,
                 nice: int = 10) -> PictureService | forkserver.SideJob | None:
    """``layout.txt`` now (a write error ends the run before any rank starts), ``layout.png``
    drawn beside the ranks' start: where this process launches them (``serve``), by its picture
    service, which goes on to draw for them (app/output/pictures.py); else (a joined job's
    rank 0, ``plan_only``) in a process of its own (app/launch/forkserver.py: SideJob), at a low
    priority unless the user waits for it. None where neither can be had (then the caller draws
    it)."""
    if not sys.platform.startswith("linux"):
        return None
    write_layout_text(plan, run_dir)
    picture, png = describe_layout(plan), run_dir / "layout.png"
    if serve:
        return PictureService(functools.partial(draw_layout_file, picture, png))
    return forkserver.SideJob("layout", draw_layout_file, picture, png, nice=nice)


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """``variables`` set in this process's environment for the ``with`` block."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> dict[str, Any] | None:
    global _first_job
    mark_job_start()
    timeline.reset()
    timeline.mark("start", timeline.process_start_time() if _first_job else None)
    timeline.mark("composed")  # Hydra is done: imports and composition behind us
    _first_job = False
    quiet_file_errors()  # Hydra's __main__.log on a full disk: one line, not a traceback each
    hydra_cfg = HydraConfig.get()
    try:
        return run(cfg, Path(hydra_cfg.runtime.output_dir))
    except RlcommError as err:
        # An interrupt (exit_code 128 + signal) ends a sweep too; other errors fail one job.
        exit_code = getattr(err, "exit_code", 2)
        if hydra_cfg.mode == RunMode.MULTIRUN and exit_code == 2:
            raise  # Hydra records the job as failed and runs the rest of the sweep
        say_error(str(err))
        sys.exit(exit_code)


def main() -> None:
    """``python -m app`` and ``rlcomm-run``. Once the run is over the process ends at once:
    nothing is left to wait for (every rank has exited, every file is written), and tearing
    down an interpreter that holds torch takes about a second on 2 busy cores."""
    try:
        _main()
    except SystemExit as done:
        _exit(done.code)
        raise
    _exit(0)


def _exit(code: object) -> None:
    """Ends ``python -m app`` now: the exit handlers run (logs flushed and closed,
    multiprocessing's own cleanup), the interpreter's teardown does not. Called from a test
    or tool that imported the app, it returns and the caller goes on."""
    if not forkserver.invoked_as_app():
        return
    if isinstance(code, str):  # sys.exit("message"): the message, exit code 1
        print(code, file=sys.stderr)
        code = 1
    status = code if isinstance(code, int) else (0 if code is None else 1)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
