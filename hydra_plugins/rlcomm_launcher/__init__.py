"""rlcomm's submitit launchers (hydra/launcher=rlcomm_slurm, rlcomm_local); logic in app/launch/slurm.py.

Hydra instantiates launcher plugins only from the ``hydra_plugins`` namespace package.
"""

from app.launch.slurm import RlcommLauncher


class SlurmLauncher(RlcommLauncher):
    _EXECUTOR = "slurm"


class LocalLauncher(RlcommLauncher):
    _EXECUTOR = "local"
