"""rlcomm's sweep launchers, where Hydra looks for launcher plugins: ``hydra/launcher=rlcomm_basic``
(the default), ``rlcomm_slurm`` and ``rlcomm_local``. They live in app/hydra/; this package only
re-exports them (Hydra instantiates launcher plugins only from the ``hydra_plugins`` namespace).
"""

from app.hydra.submitit import RlcommLocalLauncher, RlcommSlurmLauncher
from app.hydra.sweep_jobs import RlcommBasicLauncher

__all__ = ["RlcommBasicLauncher", "RlcommLocalLauncher", "RlcommSlurmLauncher"]
