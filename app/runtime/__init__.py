"""The RL runtime: everything of an RL job that is not the algorithm.

Roles from the plan, environments (``loop.env``), collection into segments tagged with their
weights version, moving segments to the trainers, weight sync with ``max_staleness`` and
verification, observation and reward normalisation, the stop rule, checkpoints, and every record
of the run. An algorithm plugs in four things (:mod:`app.runtime.core.algorithm`) and becomes a loop
by subclassing :class:`RLLoop` (docs/custom-algorithm.md).

Modules and folders, in the order a run uses them (docs/how-a-rank-runs.md draws them):
``settings.py`` (``loop.*``), ``validation.py`` (their checks before any rank starts),
``builders.py`` (what they build) and ``loop.py`` (the loop's hooks and the entry every rank
calls), ``envs/`` (environments, their normalisation and observation history), ``models/``
(the policies), ``worker.py`` (collecting), ``segments.py`` (a segment's bytes), ``sharding.py``
(what a trainer trains), ``compose.py`` (a rank's parts, by the plan), ``roles/`` (collector,
trainer, decider), ``handoff/`` (what moves between ranks), ``replay/`` (off-policy algorithms'
replay), ``run.py`` (one rank's update loop), ``evaluation/``, ``records/`` and
``checkpoints/``.
"""

from app.runtime.core.algorithm import (
    Algorithm,
    AlgorithmSettings,
    Record,
    Segment,
    Spaces,
    UpdateInfo,
)
from app.runtime.loop import RLLoop

__all__ = ["Algorithm", "AlgorithmSettings", "RLLoop", "Record", "Segment", "Spaces", "UpdateInfo"]
