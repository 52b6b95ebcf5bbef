"""What a user declares about a layout: :class:`LayoutSpec`, each field with its one-line doc.

The docs live in plain dataclass metadata (``metadata["doc"]``) so that a front end (the app's
config schema and ``--help``) can show them without this module knowing of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# The ranks of one role: a list of ranks, a count N (the N lowest ranks the other role does not
# name), or ranges such as "0-3,8,10-11". The list comes first: it is the canonical form.
RankSelection = Sequence[int] | int | str


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass
class LayoutSpec:
    """What a user declares; everything not given is derived by :func:`plan_layout`."""

    world_size: int = field(metadata=_doc("number of ranks"))
    ranks_per_node: int | None = field(
        default=None, metadata=_doc("ranks per node (null: all on one node)")
    )
    nodes: int | None = field(
        default=None, metadata=_doc("number of nodes (checked against ranks_per_node)")
    )
    trainers: RankSelection | None = field(
        default=None,
        metadata=_doc(
            "ranks that train (DDP over TRAIN_DATA_PARALLEL): [0,1], a count 2 (the first 2 "
            'ranks) or ranges "0-3,8"'
        ),
    )
    rollouts: RankSelection | None = field(
        default=None,
        metadata=_doc(
            "ranks that step environments: a list, count or ranges (after the trainers); "
            "null: every rank that is not a trainer; []: none (colocated)"
        ),
    )
    replay: RankSelection | None = field(
        default=None,
        metadata=_doc(
            "ranks that hold the replay (an off-policy loop's replay server): a list, count or "
            "ranges, apart from trainers and rollouts; null or []: none (a replay per trainer)"
        ),
    )
    groups: Mapping[str, Sequence[Sequence[int]]] = field(
        default_factory=dict,
        metadata=_doc("explicit rank lists per mode; override what is derived"),
    )
    tensor_parallel_size: int | None = field(
        default=None, metadata=_doc("TENSOR_PARALLEL group size (a Megatron grid over the trainer ranks)")
    )
    sequence_parallel_size: int | None = field(
        default=None, metadata=_doc("SEQUENCE_PARALLEL group size (over the trainer ranks)")
    )
    data_parallel_size: int | None = field(
        default=None, metadata=_doc("DATA_PARALLEL size: trainers / (tensor x sequence), checked")
    )
    trainer_replicas: int = field(
        default=1,
        metadata=_doc(
            "replica groups the trainers split into, each holding the whole trainer grid "
            "(DATA_PARALLEL inside it, gradients averaged across them): under sharding, a lost "
            "rank takes its replica out and the others go on (docs/failures.md); must divide "
            "the data-parallel size"
        ),
    )
    elastic_rollouts: bool = field(
        default=True,
        metadata=_doc(
            "rollout ranks may leave and join while the run goes on (membership epochs over "
            "WEIGHT_TRANSFER); false: static groups, a lost rollout rank ends the run"
        ),
    )
    elastic_trainers: bool | None = field(
        default=None,
        metadata=_doc(
            "a lost trainer (not the lead, rank 0) leaves the others training: they form the "
            "next TRAIN_DATA_PARALLEL group and take its rollout ranks; null: on where it can "
            "be (the RL runtime, elastic rollout ranks, unsharded trainers); false: a lost "
            "trainer ends the run"
        ),
    )
