"""Every job of a ``--multirun`` sweep validated before any job starts.

A sweep's launcher receives each job's overrides (Hydra's sweeper expanded them). Before it runs
or submits the first job, :func:`refuse_bad_jobs` composes each job's config as that job will
see it and runs the checks a single run runs before launch (app/launch/planning.py:
:func:`~app.launch.planning.validate_job`). The first bad job ends the sweep with one line that
names the job, its overrides, the field and the value, and exit code 2, so that no job of a
sweep that cannot finish spends its time (or a cluster's allocation) first; the sweep dir is
left free for the fixed sweep.

Used by every sweep launcher the app ships: the basic one (``hydra/launcher=rlcomm_basic``, the
default; :class:`RlcommBasicLauncher`) and the submitit ones (``rlcomm_local``,
``rlcomm_slurm``; app/hydra/submitit.py: ``RlcommLauncher.launch``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.utils import JobReturn, filter_overrides
from hydra.errors import HydraException
from hydra.types import HydraContext
from omegaconf import DictConfig, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from app.hydra import PLUGIN_MODULE
from app.launch.rundir import withdraw_sweep
from rlcomm import RlcommError, resolve_backend


def refuse_bad_jobs(
    hydra_context: HydraContext, config: DictConfig, job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int, ranks_here: bool,
) -> None:
    """Validates every job; the first bad one: ``error: sweep job #N (overrides): <problem>`` on
    stderr and exit 2, before any job starts. ``ranks_here``: the jobs' ranks run on this
    machine, so it is checked as a single run checks it: the env built (its spaces probed) and
    the backend (nccl needs CUDA). Otherwise (SLURM) the checks that build nothing run here
    (the loop's ``validate_settings``), and the job's rank 0 builds the env where it runs: a
    submitting host need not be able to (a GPU, a licence, a package only the nodes have)."""
    for num, overrides in enumerate(job_overrides, start=initial_job_idx):
        problem = job_problem(hydra_context, config, overrides, ranks_here)
        if problem is not None:
            what = " ".join(filter_overrides(overrides)) or "(no overrides)"
            print(f"error: sweep job #{num} ({what}): {problem}", file=sys.stderr, flush=True)
            withdraw_sweep(Path(str(config.hydra.sweep.dir)))
            sys.exit(2)


def job_problem(
    hydra_context: HydraContext, config: DictConfig, overrides: Sequence[str], ranks_here: bool,
) -> str | None:
    """Why the job of these ``overrides`` would fail before its ranks start (one line), or None."""
    from app.launch.planning import validate_job  # imports the loops: after the sweep is known

    try:
        cfg = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    except (HydraException, OmegaConfBaseException) as err:  # e.g. seed=abc, layout=nosuch
        return _first_line(err)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]  # the job's own config, as Hydra hands it to the job
    try:
        validate_job(cfg, probe=ranks_here)
        if ranks_here:
            resolve_backend(cfg.comm.backend)
    except RlcommError as err:
        return str(err)
    return None


def _first_line(err: Exception) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    cause = err.__cause__
    if cause is not None and str(cause).strip():  # Hydra's wrapper says which override, the
        lines.append(str(cause).strip().splitlines()[0])  # cause what is wrong with it
    return ": ".join(lines[:2]) if lines else type(err).__name__


class RlcommBasicLauncher(BasicLauncher):
    """``hydra/launcher=rlcomm_basic``: Hydra's basic launcher (each job in this process, one
    after another), every job validated before the first runs."""

    __module__ = PLUGIN_MODULE  # where Hydra registers it (app/hydra/__init__.py)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        assert self.hydra_context is not None and self.config is not None
        refuse_bad_jobs(self.hydra_context, self.config, job_overrides, initial_job_idx,
                        ranks_here=True)
        runs: Sequence[JobReturn] = super().launch(job_overrides, initial_job_idx)
        return runs

