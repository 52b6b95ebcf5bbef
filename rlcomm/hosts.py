"""Where the ranks run: every rank's host, agreed over the rendezvous store before any group.

The layout's notion of a node is only a plan; the hosts the launcher actually put the ranks on
decide (see :func:`rlcomm.layout.place_on_hosts`). Exchanged over the store, as plain strings,
so it costs no collective and works before any group exists.
"""

from __future__ import annotations

import socket

from .collectives import barrier
from .context import CommContext
from .layout import LayoutPlan, place_on_hosts
from .modes import CommMode


def gather_hosts(ctx: CommContext, host: str | None = None) -> list[str]:
    """Every rank's host name (``socket.gethostname()`` unless given), indexed by rank."""
    store = ctx.store
    rank, world = ctx.get_global_rank(), ctx.get_world_size(CommMode.GLOBAL)
    store.set(f"host/{rank}", host or socket.gethostname())
    keys = [f"host/{r}" for r in range(world)]
    store.wait(keys)
    hosts = [value.decode() for value in store.multi_get(keys)]
    # Nobody leaves (e.g. on a mismatch, the store's host among them) before all have read.
    barrier(ctx, CommMode.GLOBAL)
    return hosts


def agree_on_hosts(
    ctx: CommContext, plan: LayoutPlan, host: str | None = None, simulated_nodes: bool = False
) -> tuple[LayoutPlan, list[str]]:
    """``plan`` checked against the hosts the ranks run on (its node groups fitted to them when
    it leaves nodes open), and the hosts by rank. Call after ``init_distributed_env``, before
    creating the plan's groups; a mismatch raises the same one-line LayoutError on every rank.

    ``simulated_nodes``: the ranks were deliberately started on one machine (the app's own local
    launcher), so a layout's declared nodes are kept as simulated nodes instead of checked.
    """
    if ctx.backend == "fake":  # one process simulating every rank: no hosts to ask
        return plan, [host or socket.gethostname()] * plan.world_size
    hosts = gather_hosts(ctx, host)
    if simulated_nodes and plan.nodes_declared:
        return plan, hosts
    return place_on_hosts(plan, hosts), hosts
