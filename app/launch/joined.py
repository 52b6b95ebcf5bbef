"""The joined launcher: this process is one rank that something else started.

torchrun (its elastic agent), a task of an srun job step, or a process with RANK and WORLD_SIZE
set by hand: each rank is its own ``python -m app``, which validates the config itself and
then runs its rank (app/launch/rank.py). Only rank 0 builds what validation builds (the env it
probes for its spaces); after the rendezvous every other rank takes the spaces rank 0 probed
from the store. Which of them started it, and the rank, world size and
rendezvous address, are read from the environment by app/launch/environment.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.api import RankEnv
    from app.launch.planning import ValidatedJob
    from rlcomm import LayoutPlan


class JoinedLauncher:
    """One rank of a run another program launched (the :class:`app.launch.launcher.Launcher`
    contract)."""

    name = "joined"
    starts_ranks = False

    def claims(self, env: RankEnv, engine: str) -> bool:
        return env.joins

    def launch(self, job: ValidatedJob, plan: LayoutPlan, run_dir: Path) -> dict[str, Any] | None:
        from app.launch.rank import run_rank  # imports torch: after the checks that need none

        # This process validated the config itself (rank 0 alone probed the env): run_rank
        # gives the loop the spaces rank 0 probed.
        return run_rank(job, plan, str(run_dir))
