"""A task of a submitit job: one rank per SLURM task (or per task of a local submitit job).

The jobs are submitted by Hydra's launcher plugins ``hydra/launcher=rlcomm_slurm`` and
``rlcomm_local`` (app/hydra/submitit.py). In each task, :class:`SubmititLauncher` (the
:class:`app.launch.launcher.Launcher` contract) runs that task's rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.launch.environment import submitit_executor
from app.launch.joined import JoinedLauncher

if TYPE_CHECKING:
    from app.api import RankEnv


class SubmititLauncher(JoinedLauncher):
    """One task of a job that ``hydra/launcher=rlcomm_slurm`` or ``rlcomm_local`` submitted
    (app/hydra/submitit.py): one rank, run as any joined rank is (srun started it on SLURM;
    submitit's local executor started it here)."""

    name = "submitit"

    def claims(self, env: RankEnv, engine: str) -> bool:
        return env.launcher == "submitit" or (env.launcher == "slurm"
                                              and submitit_executor() == "slurm")
