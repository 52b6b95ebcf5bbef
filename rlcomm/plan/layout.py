"""Layout planning: which groups every rank must create, validated without any process group.

Pure Python (no torch import) so that ``plan_only`` and the launching process can reject a bad
layout before a single rank starts, and so that planning 65,536 ranks stays well under a second.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from rlcomm.errors import LayoutError
from rlcomm.modes import ParallelMode, is_known_mode, known_mode_names, mode_name
from rlcomm.plan.ranks import RankLists, is_int, resolve_roles, validate_rank_lists
from rlcomm.plan.spec import LayoutSpec, RankSelection
from rlcomm.utils import format_ranks

# The modes of a trainer grid (a device mesh's dimensions; rlcomm/mesh.py).
GRID_MODES = (
    ParallelMode.DATA_PARALLEL.value,
    ParallelMode.SEQUENCE_PARALLEL.value,
    ParallelMode.TENSOR_PARALLEL.value,
)

__all__ = [
    "GroupSpec",
    "LayoutPlan",
    "LayoutSpec",
    "RankLists",
    "RankSelection",
    "format_plan",
    "grid_groups",
    "place_on_hosts",
    "plan_layout",
    "validate_rank_lists",
]

# Creation order of derived groups; every rank must call new_group in the same order.
_DERIVED_ORDER = (
    ParallelMode.INTRA_NODE,
    ParallelMode.INTER_NODE,
    ParallelMode.TRAIN_DATA_PARALLEL,
    ParallelMode.WEIGHT_TRANSFER,
    ParallelMode.TENSOR_PARALLEL,
    ParallelMode.SEQUENCE_PARALLEL,
    ParallelMode.DATA_PARALLEL,
    ParallelMode.REPLAY,
)


@dataclass(frozen=True)
class GroupSpec:
    """All groups of one mode, as declared (torch sorts each list; the declared order is kept
    so that e.g. a WEIGHT_TRANSFER list names its sender first)."""

    mode: str
    rank_lists: RankLists

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        for ranks in self.rank_lists:
            if rank in ranks:
                return ranks
        return None


@dataclass(frozen=True)
class LayoutPlan:
    world_size: int
    ranks_per_node: int
    nodes: int
    trainers: tuple[int, ...]
    rollouts: tuple[int, ...]
    groups: tuple[GroupSpec, ...]
    # The layout fixed which ranks share a node (ranks_per_node, nodes, or INTRA_NODE/INTER_NODE
    # lists); otherwise the node groups follow the hosts the ranks land on (place_on_hosts).
    nodes_declared: bool = True
    # Rollout ranks may leave and join while the run goes on (rlcomm.elastic): every group that
    # contains one is elastic (:attr:`elastic_modes`); trainers and their groups stay static.
    elastic_rollouts: bool = False
    # Trainers other than the lead may be lost while the others go on (app/runtime/trainer/):
    # TRAIN_DATA_PARALLEL is re-formed per membership epoch of the trainers. Both flags are the
    # spec's: a front end that decides them (the app's launcher: where its runtime can follow)
    # plans with what it decided.
    elastic_trainers: bool = False
    # Ranks that hold an off-policy loop's replay (layout.replay): collectors write to them and
    # trainers sample from them, point to point over the REPLAY group (every rank).
    replay: tuple[int, ...] = ()
    # Replica groups of the trainers (layout.trainer_replicas): contiguous blocks of the trainers
    # in rank order, each holding the whole DATA x SEQUENCE x TENSOR grid (:attr:`replicas`).
    trainer_replicas: int = 1

    @property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """The trainers' replica groups, in rank order (one, every trainer, by default)."""
        ranks = sorted(self.trainers)
        size = len(ranks) // self.trainer_replicas
        return tuple(tuple(ranks[i : i + size]) for i in range(0, len(ranks), size))

    def replica_of(self, rank: int) -> tuple[int, ...]:
        """The replica group that holds trainer ``rank``."""
        return next(block for block in self.replicas if rank in block)

    @property
    def elastic_modes(self) -> tuple[str, ...]:
        """The modes whose groups contain rollout ranks, when those are elastic: only
        WEIGHT_TRANSFER is used once the run is going (re-formed per membership epoch); the
        others (GLOBAL, the node groups) serve the start only."""
        if not (self.elastic_rollouts and self.rollouts):
            return ()
        with_rollouts = [spec.mode for spec in self.groups
                         if any(r in self._rollout_set for ranks in spec.rank_lists for r in ranks)]
        return (ParallelMode.GLOBAL.value, *with_rollouts)

    def is_elastic_rank(self, rank: int) -> bool:
        """Whether ``rank`` may be lost while the run goes on, and replaced by a new process
        that joins it: an elastic rollout rank, or an elastic trainer other than the lead (the
        first trainer, which holds the run's records and decisions)."""
        if rank in self._rollout_set:
            return self.elastic_rollouts
        if not (self.elastic_trainers and rank in self._trainer_set):
            return False
        # Replica groups: the lead's whole replica goes with it (a lost rank takes its replica out).
        lead = self.trainers[0]
        return rank != lead and (self.trainer_replicas == 1 or rank not in self.replica_of(lead))

    @property
    def colocated(self) -> bool:
        """Trainers also step the environments (no separate rollout ranks)."""
        return not self.rollouts

    def role(self, rank: int) -> str:
        if rank in self._trainer_set:
            return "trainer+rollout" if self.colocated else "trainer"
        if rank in self._rollout_set:
            return "rollout"
        return "replay" if rank in self.replay else "idle"

    # Sets for role(): a picture or table of a 65,536-rank plan asks for many ranks' roles.
    @cached_property
    def _trainer_set(self) -> frozenset[int]:
        return frozenset(self.trainers)

    @cached_property
    def _rollout_set(self) -> frozenset[int]:
        return frozenset(self.rollouts)

    @property
    def grid_sizes(self) -> tuple[int, int, int]:
        """The trainer grid's (data, sequence, tensor) parallel sizes; a layout without one is a
        plain data-parallel grid: (trainers, 1, 1)."""
        if self.group(ParallelMode.DATA_PARALLEL) is None:
            return (len(self.trainers), 1, 1)
        sequence, tensor = (len(spec.rank_lists[0]) if spec is not None else 1
                            for spec in (self.group(ParallelMode.SEQUENCE_PARALLEL),
                                         self.group(ParallelMode.TENSOR_PARALLEL)))
        # Over every replica group: DATA_PARALLEL's own groups lie inside one (trainer_replicas).
        return (len(self.trainers) // (sequence * tensor), sequence, tensor)

    def groups_of(self, rank: int) -> dict[str, tuple[int, ...]]:
        """Mode -> the declared ranks of the group ``rank`` belongs to."""
        found = {}
        for spec in self.groups:
            ranks = spec.group_of(rank)
            if ranks is not None:
                found[spec.mode] = ranks
        return found

    def group(self, mode: str) -> GroupSpec | None:
        return next((g for g in self.groups if g.mode == mode_name(mode)), None)

    def with_rollout_rank(self, rank: int, leader: int) -> LayoutPlan:
        """This plan and one more elastic rollout rank beyond it, ``rank``, in ``leader``'s
        WEIGHT_TRANSFER group: what a process that joins a running job beyond its plan sees
        (rlcomm.elastic; the other ranks keep the plan they started with)."""
        if not self.elastic_rollouts or leader not in self._trainer_set:
            raise ValueError(f"rank {rank}: a rollout rank beyond the plan needs elastic rollout "
                             f"ranks and a trainer to lead it, not rank {leader}")
        weight_transfer = ParallelMode.WEIGHT_TRANSFER.value
        grown = []
        for spec in self.groups:
            if spec.mode == ParallelMode.GLOBAL.value:
                spec = replace(spec, rank_lists=((*spec.rank_lists[0], rank),))
            elif spec.mode == weight_transfer:
                spec = replace(spec, rank_lists=tuple(
                    (*ranks, rank) if ranks[0] == leader else ranks for ranks in spec.rank_lists))
            grown.append(spec)
        return replace(self, world_size=max(self.world_size, rank + 1),
                       rollouts=(*self.rollouts, rank), groups=tuple(grown))


    def with_trainer_rank(self, rank: int) -> LayoutPlan:
        """This plan and one more elastic trainer beyond it, ``rank``: in TRAIN_DATA_PARALLEL,
        leading a WEIGHT_TRANSFER group of its own that starts empty (rollout ranks that join
        later may go to it). Plain data-parallel trainers only: a sharded grid's or a replica
        group's shards cannot take one more rank."""
        if not self.elastic_trainers or self.trainer_replicas != 1 or self.grid_sizes[1:] != (1, 1):
            raise ValueError(f"rank {rank}: a trainer beyond the plan needs elastic data-parallel "
                             "trainers, without replica groups or a sharded grid")
        return self._with_trainers([rank], {})

    def with_replica_group(self, ranks: Sequence[int]) -> LayoutPlan:
        """This plan and one more replica group of elastic sharded trainers beyond it, on the
        consecutive ``ranks``: the grid of the first replica group laid over them (its DATA,
        TENSOR and SEQUENCE parallel groups, position for position), each rank leading a
        WEIGHT_TRANSFER group of its own that starts empty."""
        first = self.replicas[0]
        if not self.elastic_trainers or self.trainer_replicas == 1 or len(ranks) != len(first):
            raise ValueError(f"ranks {list(ranks)}: a replica group beyond the plan needs elastic "
                             f"trainers in replica groups, and {len(first)} ranks")
        grown = self._with_trainers(ranks, dict(zip(first, ranks)))
        return replace(grown, trainer_replicas=self.trainer_replicas + 1)

    def _with_trainers(self, ranks: Sequence[int], place: dict[int, int]) -> LayoutPlan:
        """This plan and the trainers ``ranks`` beyond it: in GLOBAL and TRAIN_DATA_PARALLEL,
        each leading a WEIGHT_TRANSFER group of its own that starts empty; ``place`` maps the
        first replica group's ranks onto them, whose grid groups (DATA, TENSOR, SEQUENCE
        parallel) are laid over them (none for plain data-parallel trainers)."""
        grown = []
        for spec in self.groups:
            if spec.mode in (ParallelMode.GLOBAL.value, ParallelMode.TRAIN_DATA_PARALLEL.value):
                spec = replace(spec, rank_lists=((*spec.rank_lists[0], *ranks),))
            elif spec.mode == ParallelMode.WEIGHT_TRANSFER.value:
                spec = replace(spec, rank_lists=(*spec.rank_lists, *((r,) for r in ranks)))
            elif spec.mode in GRID_MODES and place:
                laid = [tuple(place[r] for r in group) for group in spec.rank_lists
                        if set(group) <= set(place)]
                spec = replace(spec, rank_lists=(*spec.rank_lists, *laid))
            grown.append(spec)
        return replace(self, world_size=max(self.world_size, max(ranks) + 1),
                       trainers=(*self.trainers, *ranks), groups=tuple(grown))


def plan_layout(spec: LayoutSpec) -> LayoutPlan:
    """Validate ``spec`` and return every group to create, in creation order."""
    world = _check_positive_int("layout.world_size", spec.world_size)
    per_node, nodes = _node_shape(spec, world)
    trainers, rollouts, replay = resolve_roles(spec.trainers, spec.rollouts, world, spec.replay)

    explicit = {}
    for raw_mode, lists in spec.groups.items():
        name = mode_name(raw_mode)
        if not is_known_mode(name):
            raise LayoutError(
                f"layout.groups: unknown mode {name!r}; known modes: {', '.join(known_mode_names())}"
            )
        if name == ParallelMode.GLOBAL:
            raise LayoutError("layout.groups.GLOBAL: the global group is implicit; remove it")
        explicit[name] = validate_rank_lists(name, lists, world, f"layout.groups.{name}")

    derived: dict[str, RankLists] = {
        ParallelMode.INTRA_NODE: tuple(
            tuple(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)
        ),
        ParallelMode.INTER_NODE: tuple(tuple(range(i, world, per_node)) for i in range(per_node)),
        ParallelMode.TRAIN_DATA_PARALLEL: (trainers,),
    }
    if rollouts:
        derived[ParallelMode.WEIGHT_TRANSFER] = _pair_trainers(trainers, rollouts)
    replicas = _check_replicas(spec, trainers)
    derived.update(_size_groups(spec, trainers, replicas))
    if replay:  # one group for the replay's point-to-point traffic, apart from GLOBAL's
        derived[ParallelMode.REPLAY] = (tuple(range(world)),)

    ordered = [m.value for m in _DERIVED_ORDER] + [m for m in explicit if m not in _DERIVED_ORDER]
    groups = tuple(
        GroupSpec(mode, explicit[mode] if mode in explicit else derived[mode])
        for mode in ordered
        if mode in explicit or mode in derived
    )
    declared = (
        spec.ranks_per_node is not None
        or spec.nodes is not None
        or any(m in explicit for m in (ParallelMode.INTRA_NODE, ParallelMode.INTER_NODE))
    )
    return LayoutPlan(world, per_node, nodes, trainers, rollouts, groups, declared,
                      elastic_rollouts=bool(spec.elastic_rollouts),
                      elastic_trainers=spec.elastic_trainers is True, replay=replay,
                      trainer_replicas=replicas)


def place_on_hosts(plan: LayoutPlan, hosts: Sequence[str]) -> LayoutPlan:
    """The plan checked against (or fitted to) ``hosts[r]``, the host rank ``r`` runs on.

    A layout that declares its nodes must put exactly the ranks of one host in each INTRA_NODE
    group, else a one-line error names the ranks and hosts. A layout that leaves nodes open gets
    INTRA_NODE = the ranks of each host and INTER_NODE = the i-th rank of every host.
    """
    if len(hosts) != plan.world_size:
        raise LayoutError(f"hosts: {len(hosts)} hosts for world_size {plan.world_size}")
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    actual = tuple(tuple(ranks) for ranks in by_host.values())
    where = "; ".join(f"{host}: {format_ranks(ranks)}" for host, ranks in by_host.items())
    intra = plan.group(ParallelMode.INTRA_NODE)
    if plan.nodes_declared:
        planned = intra.rank_lists if intra is not None else ()
        if sorted(map(sorted, planned)) != sorted(map(sorted, actual)):
            nodes = " ".join(format_ranks(list(g)) for g in planned)
            raise LayoutError(
                f"layout: the layout's nodes {nodes} do not match the hosts the ranks run on "
                f"({where}); launch one node's ranks per host (block distribution), or set "
                "layout.ranks_per_node=null to follow the hosts"
            )
        return plan
    width = max(len(ranks) for ranks in actual)
    inter = tuple(
        tuple(ranks[i] for ranks in actual if i < len(ranks)) for i in range(width)
    )
    fitted = {ParallelMode.INTRA_NODE.value: actual, ParallelMode.INTER_NODE.value: inter}
    groups = tuple(GroupSpec(g.mode, fitted.get(g.mode, g.rank_lists)) for g in plan.groups)
    return replace(plan, ranks_per_node=width, nodes=len(actual), groups=groups)


def grid_groups(ranks: Sequence[int], mode: str, size: int, inner_size: int = 1) -> RankLists:
    """Megatron-style groups over ``ranks``: TENSOR_PARALLEL contiguous blocks of ``size``;
    SEQUENCE_PARALLEL ``size`` ranks strided by ``inner_size`` (the TP size) inside blocks of
    ``size * inner_size``; DATA_PARALLEL ``size`` ranks strided by ``len(ranks) // size``."""
    n = len(ranks)
    block = size * inner_size if mode == ParallelMode.SEQUENCE_PARALLEL else size
    if size < 1 or n % block:
        raise LayoutError(
            f"{mode}: size {size} does not divide the {n} ranks {format_ranks(list(ranks))}"
            + (f" in blocks of {block}" if block != size else "")
        )
    if mode == ParallelMode.TENSOR_PARALLEL:
        return tuple(tuple(ranks[i : i + size]) for i in range(0, n, size))
    if mode == ParallelMode.SEQUENCE_PARALLEL:
        return tuple(
            tuple(ranks[start + t : start + block : inner_size])
            for start in range(0, n, block)
            for t in range(inner_size)
        )
    if mode == ParallelMode.DATA_PARALLEL:
        stride = n // size
        return tuple(tuple(ranks[j::stride]) for j in range(stride))
    raise LayoutError(f"{mode}: not a size-based mode")


def format_plan(plan: LayoutPlan, max_ranks: int = 64) -> str:
    """A table: one row per rank, one column per mode, each cell the ranks of its group."""
    modes = [g.mode for g in plan.groups]
    header = ["rank", "node", "role", *modes]
    rows = [header]
    shown = range(min(plan.world_size, max_ranks))
    for rank in shown:
        mine = plan.groups_of(rank)
        cells = [format_ranks(mine[m]) if m in mine else "-" for m in modes]
        rows.append([str(rank), str(rank // plan.ranks_per_node), plan.role(rank), *cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if plan.world_size > max_ranks:
        lines.append(f"... {plan.world_size - max_ranks} more ranks")
    summary = ", ".join(f"{g.mode}: {len(g.rank_lists)} group(s)" for g in plan.groups)
    lines.insert(
        0,
        f"world_size={plan.world_size} nodes={plan.nodes} ranks_per_node={plan.ranks_per_node}"
        f" | {summary}",
    )
    if plan.group(ParallelMode.DATA_PARALLEL) is not None:
        data, sequence, tensor = plan.grid_sizes
        lines.insert(1, f"trainer grid: data {data} x sequence {sequence} x tensor {tensor} "
                        f"over the trainers {format_ranks(sorted(plan.trainers))}"
                        + (f", in {plan.trainer_replicas} replica groups "
                           + " | ".join(format_ranks(list(b)) for b in plan.replicas)
                           if plan.trainer_replicas > 1 else ""))
    return "\n".join(lines)


def _node_shape(spec: LayoutSpec, world: int) -> tuple[int, int]:
    per_node = spec.ranks_per_node if spec.ranks_per_node is not None else world
    per_node = _check_positive_int("layout.ranks_per_node", per_node)
    if spec.nodes is not None:
        nodes = _check_positive_int("layout.nodes", spec.nodes)
        if nodes * per_node != world:
            raise LayoutError(
                f"layout.world_size: {world} does not match ranks_per_node {per_node} x nodes {nodes}"
            )
        return per_node, nodes
    if world % per_node:
        raise LayoutError(
            f"layout.world_size: {world} is not a multiple of ranks_per_node {per_node}"
        )
    return per_node, world // per_node


def _pair_trainers(trainers: tuple[int, ...], rollouts: tuple[int, ...]) -> RankLists:
    """Trainer i with the i-th contiguous share of the rollouts, trainer first."""
    share, extra = divmod(len(rollouts), len(trainers))
    groups, start = [], 0
    for i, trainer in enumerate(trainers):
        stop = start + share + (1 if i < extra else 0)
        groups.append((trainer, *rollouts[start:stop]))
        start = stop
    return tuple(groups)


def _check_replicas(spec: LayoutSpec, trainers: tuple[int, ...]) -> int:
    replicas = _check_positive_int("layout.trainer_replicas", spec.trainer_replicas)
    if len(trainers) % replicas:
        raise LayoutError(f"layout.trainer_replicas: {replicas} does not divide the "
                          f"{len(trainers)} trainers {format_ranks(sorted(trainers))}")
    return replicas


def _size_groups(spec: LayoutSpec, trainers: tuple[int, ...],
                 replicas: int = 1) -> dict[str, RankLists]:
    """The DATA/SEQUENCE/TENSOR_PARALLEL grid, laid over the trainer ranks (in rank order):
    rollout ranks are in none of its groups. With ``replicas`` replica groups, each contiguous
    block of trainers holds a whole grid: DATA_PARALLEL groups lie inside one."""
    sizes = (spec.tensor_parallel_size, spec.sequence_parallel_size, spec.data_parallel_size)
    if all(s is None for s in sizes) and replicas == 1:
        return {}
    tp = _check_positive_int("layout.tensor_parallel_size", spec.tensor_parallel_size or 1)
    sp = _check_positive_int("layout.sequence_parallel_size", spec.sequence_parallel_size or 1)
    ranks = sorted(trainers)
    count = len(ranks)
    if count % (tp * sp):
        raise LayoutError(
            f"layout.tensor_parallel_size x sequence_parallel_size: {tp} x {sp} does not divide "
            f"the {count} trainers {format_ranks(ranks)}"
        )
    dp = count // (tp * sp)
    if spec.data_parallel_size is not None and spec.data_parallel_size != dp:
        raise LayoutError(
            f"layout.data_parallel_size: {spec.data_parallel_size} but the {count} trainers / "
            f"(tensor {tp} x sequence {sp}) = {dp}"
        )
    if dp % replicas:
        raise LayoutError(
            f"layout.trainer_replicas: {replicas} does not divide the data-parallel size {dp} "
            f"(the {count} trainers / (tensor {tp} x sequence {sp})): each replica group holds "
            "whole tensor x sequence blocks")
    block = count // replicas
    data = tuple(group for start in range(0, count, block)
                 for group in grid_groups(ranks[start : start + block],
                                          ParallelMode.DATA_PARALLEL, dp // replicas))
    return {
        ParallelMode.TENSOR_PARALLEL: grid_groups(ranks, ParallelMode.TENSOR_PARALLEL, tp),
        ParallelMode.SEQUENCE_PARALLEL: grid_groups(ranks, ParallelMode.SEQUENCE_PARALLEL, sp, tp),
        ParallelMode.DATA_PARALLEL: data,
    }


def _check_positive_int(where: str, value: object) -> int:
    if not is_int(value) or value <= 0:  # type: ignore[operator]
        raise LayoutError(f"{where}: must be a positive integer, got {value!r}")
    return value  # type: ignore[return-value]


def plan_digest(plan: LayoutPlan) -> str:
    """A digest of everything ``init_groups`` creates. Tuples of ints hash alike in every
    process (only str/bytes hashing is salted), so the rank lists, the bulk of a 65,536-rank
    plan, go through ``hash`` in C; the rest is small."""
    lists = tuple(spec.rank_lists for spec in plan.groups)
    names = [spec.mode for spec in plan.groups]
    roles = hash((plan.trainers, plan.rollouts, plan.replay, plan.ranks_per_node,
                  plan.trainer_replicas))
    text = f"{plan.world_size}/{names}/{[len(rl) for rl in lists]}/{hash(lists)}/{roles}"
    return hashlib.sha256(text.encode()).hexdigest()
