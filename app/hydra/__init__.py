"""The Hydra adapters: what Hydra calls during a ``--multirun``, above both the launch room
(app/launch/) and the sweep report (app/sweep/), which do not import each other.

- :mod:`app.hydra.sweep_jobs`: every sweep job validated before the first starts, and the basic
  sweep launcher (``hydra/launcher=rlcomm_basic``, the default);
- :mod:`app.hydra.submitit`: the submitit sweep launchers (``rlcomm_slurm``, ``rlcomm_local``);
- :mod:`app.hydra.sweep_summary`: the sweep's callback, which ranks the jobs.

Hydra instantiates launcher plugins only from the ``hydra_plugins`` namespace package: the
launcher classes are re-exported by :data:`PLUGIN_MODULE` and carry its name as their
``__module__`` (Hydra registers a plugin under it).
"""

PLUGIN_MODULE = "hydra_plugins.rlcomm_launcher"
