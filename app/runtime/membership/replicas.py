"""A lost replica group of sharded trainers rebuilt (``layout.trainer_replicas``, docs/failures.md).

Each of its ranks starts again (``launcher.trainer_restarts``, or by hand) and joins the running
job without a default group, as any replacement does; so do the ranks of a replica group beyond
the plan (``python -m app.join RUN_DIR role=replica``), announced to the lead first. A tensor-parallel or FSDP grid needs one:
the group's new processes form a world of their own over a fresh store prefix (one per rebuild,
counted by their arrivals), with the plan's grid groups inside it (``CommContext.form_subworld``).
The lead admits the group only once every rank of it asked (app/runtime/membership/trainers.py), and
each then heals from the lead's replica group (app/runtime/membership/healing.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rlcomm import CommContext, LayoutPlan
from rlcomm.elastic import Keys, subworld
from rlcomm.errors import PeerLostError

log = logging.getLogger(__name__)


def form_replica_world(ctx: CommContext, plan: LayoutPlan) -> None:
    """This joining trainer's replica group's world, with the group's other new processes."""
    rank = ctx.get_global_rank()
    replica = plan.replica_of(rank)
    counter, prefix = subworld(replica[0])
    arrivals = int(ctx.store.add(counter, 1))
    generation = (arrivals - 1) // len(replica)
    log.info("rank %d (trainer) rebuilds its replica group %s (rebuild %d): waiting for its "
             "other ranks", rank, list(replica), generation + 1)
    try:
        ctx.form_subworld(plan, replica, f"{prefix}{generation}/")
    except RuntimeError as err:  # a rank of the group that never started again
        raise PeerLostError(
            f"rank {rank} (trainer): its replica group {list(replica)} was not rebuilt within "
            f"{ctx.timeout.total_seconds():g} s: every rank of it starts again to rebuild it "
            f"(launcher.trainer_restarts) ({err})") from err


def whole_replica_groups(asked: Mapping[int, object], replicas: tuple[tuple[int, ...], ...],
                         members: list[int]) -> list[int]:
    """The ranks of ``asked`` (rank -> its join) whose whole replica group asked and is not
    among the ``members``: those the lead admits now (the others wait for their group)."""
    return [rank for replica in replicas
            if not set(replica) & set(members) and set(replica) <= set(asked)
            for rank in replica]


def announce_replica(store: Any, keys: Keys, ranks: Sequence[int]) -> None:
    """A replica group beyond the plan (``python -m app.join RUN_DIR role=replica``), before its
    processes ask to join: where the lead (``keys``: its trainers' series) reads its ranks."""
    for rank in ranks:
        store.set(keys.key(f"replica/{rank}"), json.dumps(list(ranks)))


def announced_replica(store: Any, keys: Keys, rank: int) -> tuple[int, ...] | None:
    """The replica group beyond the plan that ``rank`` was announced in, if any."""
    key = keys.key(f"replica/{rank}")
    return tuple(json.loads(store.get(key))) if store.check([key]) else None
