"""Who talks to which replay rank (``layout.replay``): the collectors' and the trainers' routes
to the replay ranks, and each replay rank's share of a learner batch. Pure functions of the
plan (and of whether the trainers write the collectors' segments on: the run's shape,
``RunShape.forwards``), used by the replay server (app/runtime/replay/service.py) and the
trainers' client (app/runtime/replay/client.py) alike."""

from __future__ import annotations

from rlcomm import LayoutPlan


def collectors(plan: LayoutPlan) -> tuple[int, ...]:
    """The ranks that collect: the rollout ranks, or the trainers of a colocated layout."""
    return plan.rollouts if plan.rollouts else plan.trainers


def replay_rank_of(plan: LayoutPlan, collector: int) -> int:
    """The replay rank ``collector`` writes to: collector i of :func:`collectors` writes to
    ``plan.replay[i mod R]``."""
    return plan.replay[collectors(plan).index(collector) % len(plan.replay)]


def forwarded_to(plan: LayoutPlan, trainer: int, count: int) -> int:
    """The replay rank the ``count``-th segment a trainer writes on goes to (``forwards``):
    trainer t of T writes its k-th to ``plan.replay[(t + k T) mod R]``, so that every replay
    rank gets its share even with fewer trainers than replay ranks."""
    trainers = plan.trainers
    return plan.replay[(trainers.index(trainer) + count * len(trainers)) % len(plan.replay)]


def writers_of(plan: LayoutPlan, replay_rank: int, forwards: bool) -> list[int]:
    """The ranks that write to ``replay_rank``: the collectors routed to it, or, when the
    trainers write on the collectors' segments (``forwards``: ``RunShape.forwards``), the
    trainers."""
    if forwards:
        return list(plan.trainers)
    return [c for c in collectors(plan) if replay_rank_of(plan, c) == replay_rank]


def batch_shares(batch_size: int, replays: int) -> list[int]:
    """How many of a learner batch's transitions each replay rank gives: as even as can be,
    the first ranks one more; every share at least one (``batch_size >= replays``)."""
    share, extra = divmod(batch_size, replays)
    return [share + (1 if i < extra else 0) for i in range(replays)]
