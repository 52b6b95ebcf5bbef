"""IMPALA-style V-trace actor-critic on the runtime (Espeholt et al. 2018).

``python -m app loop=vtrace loop.max_staleness=1``

IMPALA's actors never wait for the learner: they act with whatever weights they last received,
so the data a learner trains on was collected by an older policy. V-trace makes that correct:
truncated importance weights (``hparams.rho_bar``, ``hparams.c_bar``) turn the stale actors'
returns into value targets and policy-gradient advantages for the learner's current policy.
That makes it the natural partner of ``loop.max_staleness >= 1``, where the rollouts collect
the next segment while the trainers update: the data then lags by up to ``max_staleness``
weights versions, and V-trace corrects for exactly that lag. With ``max_staleness=0`` the data
is on-policy for the first minibatch step and V-trace is a plain actor-critic.

The maths is in ``core.py`` (:func:`~app.loops.vtrace.core.vtrace_targets`, no
``torch.distributed``); the runtime (``app/runtime/``) does everything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from app.api import setting
from app.loops.vtrace.core import VTrace, VTraceSettings, vtrace_targets
from app.runtime import Algorithm, RLLoop

__all__ = ["VTrace", "VTraceLoop", "VTraceSettings", "vtrace_targets"]


@dataclass
class VTraceLoop(RLLoop):
    """The runtime's settings plus V-trace's (``loop.hparams``)."""

    hparams: VTraceSettings = setting(doc="V-trace settings", factory=VTraceSettings)
    algorithm: ClassVar[type[Algorithm[Any]]] = VTrace
