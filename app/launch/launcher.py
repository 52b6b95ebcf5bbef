"""What a launcher is: how the ranks of one run start, and what this process does in the run.

``python -m app`` composes and validates the config, then hands the plan to the one launcher
that claims this process (:func:`launcher_for`). There are four:

- ``local`` (app/launch/local.py): this process starts ``layout.world_size`` ranks on this
  machine through torch's elastic agent and waits for them;
- ``ray`` (app/launch/ray_engine.py, ``launcher.engine=ray``): this process is the driver of a
  Ray job; it starts each rank as a Ray actor on a Ray cluster and waits for them;
- ``submitit`` (app/launch/slurm.py): this process is one task of a job that
  ``hydra/launcher=rlcomm_slurm`` or ``rlcomm_local`` submitted, and runs one rank;
- ``joined`` (app/launch/joined.py): this process is one rank that something else started:
  torchrun, an srun job step, or RANK and WORLD_SIZE set by hand.

Which one claims a process is read from its environment variables, by
app/launch/environment.py alone (:class:`app.api.RankEnv`), and, for a process that starts the
ranks itself, from ``launcher.engine``.

Adding one (say Kubernetes or TorchX): write a module with a class that has these members; if
its ranks see variables of their own, teach ``launched_by`` and ``resolve_rank_env`` in
app/launch/environment.py to read them; add the class to :data:`LAUNCHERS`, before any launcher
that would claim the same process. docs/launch.md walks through the launch path.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from app.api import RankEnv
    from app.launch.planning import ValidatedJob
    from rlcomm import LayoutPlan


class Launcher(Protocol):
    """The contract every launcher keeps."""

    name: str  # what the docs and the logs call it
    # True where this process starts the ranks and outlives them (it then serves the layout
    # picture to them); False where this process is one of the ranks.
    starts_ranks: bool

    def claims(self, env: RankEnv, engine: str) -> bool:
        """Whether this process runs under this launcher, from how it was started (``env``) and
        the engine the config names (``launcher.engine``: ``local`` or ``ray``)."""
        ...

    def launch(self, job: ValidatedJob, plan: LayoutPlan, run_dir: Path) -> dict[str, Any] | None:
        """This process's part of the run: start every rank and wait for them, or be one rank.

        ``job`` is the validated config in its typed form, its loop built (with the env's
        spaces it probed) and the run's shape derived (app/launch/planning.py), handed to every
        rank as it is; ``plan`` the validated layout (not validated again); ``run_dir`` the
        run's folder, where ``result.json`` and ``logs/`` land. Returns the run's summary
        (``result.json``) where this process holds it (the launching process, or rank 0), else
        None. A failed run raises an ``RlcommError``
        whose message is the whole ``error:`` line: :class:`app.errors.RankFailedError`, or
        :class:`app.errors.LaunchInterruptedError` for a signal.
        """
        ...


# In the order they are asked: the first that claims a process launches it. Named, not imported:
# a rank of a joined run never imports the local launcher (torch's elastic agent).
LAUNCHERS = (
    "app.launch.slurm:SubmititLauncher",
    "app.launch.joined:JoinedLauncher",
    "app.launch.ray_engine:RayLauncher",
    "app.launch.local:LocalLauncher",
)


def launcher_for(env: RankEnv, engine: str = "local") -> Launcher:
    """The launcher that claims this process (``env``: how it was started; ``engine``:
    ``launcher.engine``)."""
    engine = str(getattr(engine, "value", engine))  # an Engine (str, Enum) prints as its name
    for name in LAUNCHERS:
        module, _, cls = name.partition(":")
        launcher: Launcher = getattr(importlib.import_module(module), cls)()
        if launcher.claims(env, engine):
            return launcher
    raise LookupError(f"no launcher claims a process started by {env.launcher!r}")
