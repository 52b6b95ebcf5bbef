"""rlcomm's sweep launchers: hydra/launcher=rlcomm_basic (the default; logic in
app/launch/sweep_jobs.py) and the submitit ones, rlcomm_slurm and rlcomm_local (app/launch/slurm.py).

Hydra instantiates launcher plugins only from the ``hydra_plugins`` namespace package.
"""

from app.launch.slurm import RlcommLauncher
from app.launch.sweep_jobs import CheckedBasicLauncher


class BasicLauncher(CheckedBasicLauncher):
    pass


class SlurmLauncher(RlcommLauncher):
    _EXECUTOR = "slurm"


class LocalLauncher(RlcommLauncher):
    _EXECUTOR = "local"
