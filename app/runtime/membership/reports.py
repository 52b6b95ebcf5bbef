"""Who reports at the end of a run with elastic groups: no group spans every rank then, so rank 0
collects the reports through the store (app/launch/rank.py asks the loop which ranks:
``Loop.reporting_ranks``)."""

from __future__ import annotations

import datetime
import json

from app.runtime.membership.trainers import SPACE
from rlcomm import CommContext, LayoutPlan
from rlcomm.elastic import Keys, closing_members


def reporting_ranks(ctx: CommContext, plan: LayoutPlan, timeout_s: float) -> list[int]:
    """The trainers the lead closed the run with (with elastic trainers; else the planned
    ones), the replay ranks, and the rollout ranks each trainer had at its stop (its stop
    record, waited for up to ``timeout_s``)."""
    store = ctx.store
    trainers = closing_members(store, plan.trainers[0], SPACE) or list(plan.trainers)
    wanted = [*trainers, *plan.replay]
    for trainer in trainers:
        stopped = Keys(trainer).stopped()
        store.wait([stopped], datetime.timedelta(seconds=timeout_s))
        wanted += json.loads(store.get(stopped))["members"]
    return sorted(wanted)
