"""Pure layout planning: derivations and every validation error (no processes)."""

from __future__ import annotations

import pytest

from rlcomm import (
    LayoutError,
    LayoutPlan,
    LayoutSpec,
    ParallelMode,
    format_plan,
    grid_groups,
    plan_layout,
)
from rlcomm.modes import register_mode_name
from rlcomm.plan.layout import place_on_hosts
from rlcomm.plan.ranks import parse_ranges

pytestmark = pytest.mark.unit


def groups(spec: LayoutSpec) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {g.mode: g.rank_lists for g in plan_layout(spec).groups}


def test_default_rl_layout_derivations() -> None:
    plan = groups(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=[2, 3]))
    assert plan == {
        "INTRA_NODE": ((0, 1, 2, 3),),
        "INTER_NODE": ((0,), (1,), (2,), (3,)),
        "TRAIN_DATA_PARALLEL": ((0, 1),),
        "WEIGHT_TRANSFER": ((0, 2), (1, 3)),
    }


def test_two_nodes_and_uneven_rollout_shares() -> None:
    plan = groups(
        LayoutSpec(world_size=6, ranks_per_node=3, trainers=[0, 1], rollouts=[2, 3, 4, 5])
    )
    assert plan["INTRA_NODE"] == ((0, 1, 2), (3, 4, 5))
    assert plan["INTER_NODE"] == ((0, 3), (1, 4), (2, 5))
    plan = groups(LayoutSpec(world_size=5, trainers=[0, 1], rollouts=[2, 3, 4]))
    assert plan["WEIGHT_TRANSFER"] == ((0, 2, 3), (1, 4))


def test_colocated_layout_has_no_weight_transfer() -> None:
    plan = plan_layout(LayoutSpec(world_size=1, trainers=[0]))
    assert plan.colocated and plan.role(0) == "trainer+rollout"
    assert plan.group(ParallelMode.WEIGHT_TRANSFER) is None


def test_explicit_groups_override_and_keep_declared_order() -> None:
    register_mode_name("MY_MODE")
    plan = plan_layout(
        LayoutSpec(
            world_size=4,
            trainers=[3],
            rollouts=[0, 1, 2],
            groups={"WEIGHT_TRANSFER": [[3, 0, 1]], "MY_MODE": [[0, 1]]},
        )
    )
    assert plan.group("WEIGHT_TRANSFER").rank_lists == ((3, 0, 1),)  # type: ignore[union-attr]
    assert plan.groups_of(3)["WEIGHT_TRANSFER"] == (3, 0, 1)
    assert [g.mode for g in plan.groups][-1] == "MY_MODE"


def test_megatron_grid() -> None:
    ranks = list(range(8))
    assert grid_groups(ranks, "TENSOR_PARALLEL", 2) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert grid_groups(ranks, "SEQUENCE_PARALLEL", 2, 2) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert grid_groups(ranks, "DATA_PARALLEL", 2) == ((0, 4), (1, 5), (2, 6), (3, 7))
    plan = groups(LayoutSpec(world_size=8, trainers=ranks, tensor_parallel_size=2))
    assert plan["DATA_PARALLEL"] == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert plan["SEQUENCE_PARALLEL"] == tuple((r,) for r in ranks)


def test_plan_table_names_every_rank_and_mode() -> None:
    text = format_plan(plan_layout(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=[2, 3])))
    assert "WEIGHT_TRANSFER" in text and "rollout" in text
    assert len([line for line in text.splitlines() if line[:1].isdigit()]) == 4


BAD = [
    (dict(world_size=0, trainers=[0]), "layout.world_size: must be a positive integer, got 0"),
    (dict(world_size=-2, trainers=[0]), "layout.world_size: must be a positive integer, got -2"),
    (dict(world_size=4, trainers=[]), "layout.trainers: missing or empty"),
    (dict(world_size=4, trainers=None), "layout.trainers: missing or empty"),
    (
        dict(world_size=4, trainers=[0, 4], rollouts=[1, 2, 3]),
        "rank 4 in group [0,4] is out of range",
    ),
    (
        dict(world_size=4, trainers=[-1, 0], rollouts=[1, 2, 3]),
        "rank -1 in group [-1,0] is out of range",
    ),
    (
        dict(world_size=4, trainers=[0, 0], rollouts=[1, 2, 3]),
        "rank 0 appears twice in group [0,0]",
    ),
    (dict(world_size=4, trainers=[0, 1], rollouts=[1, 2, 3]), "ranks [1] are also trainers"),
    (dict(world_size=4, trainers=[0, "x"], rollouts=[2, 3]), "rank 'x' is not an integer"),
    (
        dict(world_size=4, trainers=[0, 1], rollouts=[2]),
        "ranks [3] are neither trainers nor rollouts",
    ),
    (dict(world_size=3, trainers=[0, 1], rollouts=[2]), "1 rollout ranks cannot serve 2 trainers"),
    (
        dict(world_size=4, ranks_per_node=3, trainers=[0, 1, 2, 3]),
        "4 is not a multiple of ranks_per_node 3",
    ),
    (
        dict(world_size=4, ranks_per_node=2, nodes=3, trainers=[0, 1, 2, 3]),
        "4 does not match ranks_per_node 2 x nodes 3",
    ),
    (
        dict(world_size=4, trainers=[0, 1, 2, 3], tensor_parallel_size=3),
        "3 x 1 does not divide the 4 trainers [0,1,2,3]",
    ),
    (
        dict(world_size=4, trainers=[0, 1, 2, 3], tensor_parallel_size=2, data_parallel_size=4),
        "layout.data_parallel_size: 4 but the 4 trainers",
    ),
    (dict(world_size=4, trainers=[0, 1, 2, 3], groups={"NOPE": [[0]]}), "unknown mode 'NOPE'"),
    (
        dict(world_size=4, trainers=[0, 1, 2, 3], groups={"WEIGHT_TRANSFER": [[0, 1], []]}),
        "layout.groups.WEIGHT_TRANSFER[1]: empty group",
    ),
    (
        dict(world_size=4, trainers=[0, 1, 2, 3], groups={"WEIGHT_TRANSFER": [[0, 1], [1, 2]]}),
        "rank 1 appears in two groups of one mode: [0,1] and [1,2]",
    ),
    (
        dict(world_size=4, trainers=[0, 1, 2, 3], groups={"TRAIN_DATA_PARALLEL": "0,1"}),
        "expected a non-empty list of rank lists",
    ),
]


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_layouts_fail_with_one_line_naming_field_and_value(fields: dict, message: str) -> None:
    with pytest.raises(LayoutError) as info:
        plan_layout(LayoutSpec(**fields))
    text = str(info.value)
    assert message in text and "\n" not in text
    assert text.startswith("layout")


def test_65536_alternating_ranks_get_8192_nodes_and_32768_pairs() -> None:
    world = 65536
    plan = plan_layout(
        LayoutSpec(
            world_size=world,
            ranks_per_node=8,
            trainers=list(range(0, world, 2)),
            rollouts=list(range(1, world, 2)),
        )
    )
    sizes = {g.mode: len(g.rank_lists) for g in plan.groups}
    assert sizes == {
        "INTRA_NODE": 8192,
        "INTER_NODE": 8,
        "TRAIN_DATA_PARALLEL": 1,
        "WEIGHT_TRANSFER": 32768,
    }
    assert plan.groups_of(65535)["WEIGHT_TRANSFER"] == (65534, 65535)


# ---- placing a plan on the hosts the ranks actually run on ----------------------------------


def _nodes(plan: LayoutPlan) -> dict[str, tuple[tuple[int, ...], ...]]:
    return {g.mode: g.rank_lists for g in plan.groups if g.mode in ("INTRA_NODE", "INTER_NODE")}


def test_declared_nodes_that_match_the_hosts_are_kept() -> None:
    plan = plan_layout(LayoutSpec(world_size=4, ranks_per_node=2, trainers=[0, 2], rollouts=[1, 3]))
    assert place_on_hosts(plan, ["a", "a", "b", "b"]) is plan


@pytest.mark.parametrize(("hosts", "where"), [
    (["a", "b", "a", "b"], "(a: [0,2]; b: [1,3])"),  # cyclic distribution
    (["a"] * 4, "(a: [0,1,2,3])"),  # all on one host, the layout says 2 nodes
    (["a", "a", "a", "b"], "(a: [0,1,2]; b: [3])"),  # SLURM packing 3 + 1
])
def test_declared_nodes_that_disagree_with_the_hosts_are_one_clear_error(
    hosts: list[str], where: str
) -> None:
    plan = plan_layout(LayoutSpec(world_size=4, ranks_per_node=2, trainers=[0, 2], rollouts=[1, 3]))
    with pytest.raises(LayoutError) as err:
        place_on_hosts(plan, hosts)
    assert str(err.value).startswith(
        f"layout: the layout's nodes [0,1] [2,3] do not match the hosts the ranks run on {where}")
    assert "\n" not in str(err.value)


def test_one_node_declared_but_two_hosts_is_an_error() -> None:
    plan = plan_layout(LayoutSpec(world_size=2, ranks_per_node=2, trainers=[0], rollouts=[1]))
    with pytest.raises(LayoutError, match=r"nodes \[0,1\] do not match .*\(a: \[0\]; b: \[1\]\)"):
        place_on_hosts(plan, ["a", "b"])


def test_open_nodes_follow_the_hosts() -> None:
    plan = plan_layout(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=[2, 3]))
    assert not plan.nodes_declared
    cyclic = place_on_hosts(plan, ["a", "b", "a", "b"])
    assert _nodes(cyclic) == {"INTRA_NODE": ((0, 2), (1, 3)), "INTER_NODE": ((0, 1), (2, 3))}
    assert (cyclic.nodes, cyclic.ranks_per_node) == (2, 2)
    packed = place_on_hosts(plan, ["a", "a", "a", "b"])
    assert _nodes(packed) == {"INTRA_NODE": ((0, 1, 2), (3,)),
                              "INTER_NODE": ((0, 3), (1,), (2,))}
    assert place_on_hosts(plan, ["a"] * 4).groups == plan.groups  # one host: as planned


# ---- roles by count and ranges; rollouts left unset are the rest of the ranks ---------------


def roles(**fields: object) -> tuple[tuple[int, ...], tuple[int, ...]]:
    plan = plan_layout(LayoutSpec(**fields))  # type: ignore[arg-type]
    return plan.trainers, plan.rollouts


def test_every_layout_field_has_its_one_line_doc() -> None:
    from dataclasses import fields

    docs = {f.name: f.metadata.get("doc", "") for f in fields(LayoutSpec)}
    assert all(docs.values()) and all("\n" not in doc for doc in docs.values())


@pytest.mark.parametrize(("text", "ranks"), [
    ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
    ("5", (5,)),
    ("3-3", (3,)),
    (" 2 , 0 - 1 ", (2, 0, 1)),  # the order written; spaces are fine
    ("0-11", tuple(range(12))),
])
def test_ranges_parse_in_the_order_written(text: str, ranks: tuple[int, ...]) -> None:
    assert parse_ranges("layout.trainers", text, 12) == ranks


BAD_RANGES = [
    ("3-1", "layout.trainers: range '3-1' runs backwards; write 1-3"),
    ("0-1,5-2", "layout.trainers: range '5-2' in '0-1,5-2' runs backwards; write 2-5"),
    ("a-b", "layout.trainers: 'a-b' is not a rank (8) or a range (0-3)"),
    ("0-3,x", "layout.trainers: 'x' in '0-3,x' is not a rank (8) or a range (0-3)"),
    ("0-3,,8", "layout.trainers: '' in '0-3,,8' is not a rank"),
    ("0-3,", "layout.trainers: '' in '0-3,' is not a rank"),
    ("-1", "layout.trainers: '-1' is not a rank"),
    ("1-", "layout.trainers: '1-' is not a rank"),
    ("+3", "layout.trainers: '+3' is not a rank"),
    ("1_0", "layout.trainers: '1_0' is not a rank"),
    ("0..3", "layout.trainers: '0..3' is not a rank"),
    ("0-12", "layout.trainers: rank 12 in '0-12' is out of range for world_size 12"),
    ("0-99999999999999", "rank 99999999999999 in '0-99999999999999' is out of range"),
    ("0-3,2", "layout.trainers: rank 2 appears twice in '0-3,2'"),
    ("4,0-4", "layout.trainers: rank 4 appears twice in '4,0-4'"),
]


@pytest.mark.parametrize(("text", "message"), BAD_RANGES, ids=[t for t, _ in BAD_RANGES])
def test_bad_ranges_are_one_line_naming_field_and_value(text: str, message: str) -> None:
    with pytest.raises(LayoutError) as info:
        parse_ranges("layout.trainers", text, 12)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_count_range_and_list_of_the_same_ranks_plan_the_same() -> None:
    as_lists = plan_layout(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=[2, 3]))
    for trainers, rollouts in [(2, None), ("0-1", None), ([0, 1], None), (2, 2), ("0-1", "2-3"),
                               (2, "2,3"), ("0,1", [2, 3]), ([0, 1], 2)]:
        plan = plan_layout(LayoutSpec(world_size=4, trainers=trainers, rollouts=rollouts))
        assert plan == as_lists, (trainers, rollouts)


def test_rollouts_left_unset_are_every_rank_that_is_not_a_trainer() -> None:
    assert roles(world_size=4, trainers=1) == ((0,), (1, 2, 3))
    assert roles(world_size=4, trainers=[0]) == ((0,), (1, 2, 3))  # a list too
    assert roles(world_size=6, trainers="1,4") == ((1, 4), (0, 2, 3, 5))
    assert roles(world_size=6, trainers=[4, 1]) == ((4, 1), (0, 2, 3, 5))  # list order kept
    assert roles(world_size=6, trainers="4,1") == ((4, 1), (0, 2, 3, 5))  # ranges' order too


def test_trainers_that_are_every_rank_are_colocated_however_written() -> None:
    for trainers in (4, "0-3", [0, 1, 2, 3]):
        for rollouts in (None, [], ""):
            plan = plan_layout(LayoutSpec(world_size=4, trainers=trainers, rollouts=rollouts))
            assert plan.colocated and plan.rollouts == ()
            assert plan.role(3) == "trainer+rollout"
            assert plan.group(ParallelMode.WEIGHT_TRANSFER) is None


def test_empty_rollouts_still_mean_colocated_not_the_rest() -> None:
    for rollouts in ([], (), ""):
        with pytest.raises(LayoutError, match=r"^layout: ranks \[1,2,3\] are neither trainers"):
            plan_layout(LayoutSpec(world_size=4, trainers=[0], rollouts=rollouts))


def test_a_count_takes_the_lowest_ranks_the_other_role_does_not_name() -> None:
    assert roles(world_size=4, trainers=1, rollouts="0-2") == ((3,), (0, 1, 2))
    assert roles(world_size=4, trainers=2, rollouts=[0, 2]) == ((1, 3), (0, 2))
    assert roles(world_size=5, trainers=1, rollouts=4) == ((0,), (1, 2, 3, 4))  # trainers first
    assert roles(world_size=6, trainers="0,3", rollouts=4) == ((0, 3), (1, 2, 4, 5))
    assert roles(world_size=6, trainers=[5, 3], rollouts=4) == ((5, 3), (0, 1, 2, 4))


def test_a_65536_rank_layout_from_a_count_and_from_ranges() -> None:
    world = 65536
    plan = plan_layout(LayoutSpec(world_size=world, trainers=1))
    assert plan.trainers == (0,) and plan.rollouts == tuple(range(1, world))
    assert plan.group("WEIGHT_TRANSFER").rank_lists == (tuple(range(world)),)  # type: ignore[union-attr]
    assert plan.role(65535) == "rollout"
    plan = plan_layout(LayoutSpec(world_size=world, ranks_per_node=8, trainers="0-1023"))
    sizes = {g.mode: len(g.rank_lists) for g in plan.groups}
    assert sizes["WEIGHT_TRANSFER"] == 1024 and sizes["INTRA_NODE"] == 8192
    assert plan.groups_of(1024)["WEIGHT_TRANSFER"][0] == 0  # trainer 0 feeds the first share
    assert len(plan.group("WEIGHT_TRANSFER").rank_lists[0]) == 64  # type: ignore[union-attr]


def test_the_plan_table_of_65536_ranks_is_summarised() -> None:
    text = format_plan(plan_layout(LayoutSpec(world_size=65536, trainers=1)))
    lines = text.splitlines()
    assert len(lines) == 1 + 2 + 64 + 1 and lines[-1] == "... 65472 more ranks"
    assert max(map(len, lines)) < 200  # each group written short: [0,1,...,65535](65536)
    assert "[0,1,2,3,4,5,6,...,65535](65536)" in lines[3]


BAD_ROLES = [
    (dict(world_size=4, trainers=0), "layout.trainers: a count must be at least 1, got 0"),
    (dict(world_size=4, trainers=-2), "layout.trainers: a count must be at least 1, got -2"),
    (
        dict(world_size=4, trainers=1, rollouts=0),
        "layout.rollouts: a count must be at least 1, got 0; [] means no rollout ranks",
    ),
    (dict(world_size=4, trainers=5), "layout.trainers: count 5 is more than world_size 4"),
    (dict(world_size=4, trainers=1, rollouts=5), "layout.rollouts: count 5 is more than world_size 4"),
    (
        dict(world_size=4, trainers=3, rollouts=[0, 1]),
        "layout.trainers: count 3 but only 2 ranks are not rollouts (world_size 4)",
    ),
    (
        dict(world_size=4, trainers=1, rollouts="0-3"),
        "layout.trainers: count 1 but only 0 ranks are not rollouts (world_size 4)",
    ),
    (
        dict(world_size=4, trainers=2, rollouts=3),
        "layout.rollouts: count 3 but only 2 ranks are not trainers (world_size 4)",
    ),
    (
        dict(world_size=4, trainers=1, rollouts=2),
        "layout: ranks [3] are neither trainers nor rollouts (world_size 4)",
    ),
    (dict(world_size=4, trainers="3-1"), "layout.trainers: range '3-1' runs backwards"),
    (dict(world_size=4, trainers="a-b"), "layout.trainers: 'a-b' is not a rank (8) or a range"),
    (dict(world_size=4, trainers=1, rollouts="1,x"), "layout.rollouts: 'x' in '1,x' is not a rank"),
    (
        dict(world_size=4, trainers="0-4"),
        "layout.trainers: rank 4 in '0-4' is out of range for world_size 4",
    ),
    (dict(world_size=4, trainers=1, rollouts="1-9"), "layout.rollouts: rank 9 in '1-9' is out of"),
    (dict(world_size=4, trainers="0-1,1"), "layout.trainers: rank 1 appears twice in '0-1,1'"),
    (
        dict(world_size=4, trainers="0-1", rollouts="1-3"),
        "layout.rollouts: ranks [1] are also trainers; roles must not overlap",
    ),
    (
        dict(world_size=8, trainers="0-3", rollouts="2-7"),
        "layout.rollouts: ranks [2,3] are also trainers",
    ),
    (
        dict(world_size=5, trainers="0-1,3", rollouts="2,4"),
        "layout.rollouts: 2 rollout ranks cannot serve 3 trainers",
    ),
    (dict(world_size=4, trainers=""), "layout.trainers: missing or empty"),
    (dict(world_size=4, trainers=" "), "layout.trainers: missing or empty"),
    (
        dict(world_size=4, trainers=True),
        'layout.trainers: expected a list of ranks [0,1], a count 2 or ranges "0-3,8", got True',
    ),
    (dict(world_size=4, trainers=2.5), "layout.trainers: expected a list of ranks"),
    (dict(world_size=4, trainers=1, rollouts={"a": 1}), "layout.rollouts: expected a list of ranks"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_ROLES, ids=[m for _, m in BAD_ROLES])
def test_bad_counts_and_ranges_fail_with_one_line_naming_field_and_value(
    fields: dict, message: str
) -> None:
    with pytest.raises(LayoutError) as info:
        plan_layout(LayoutSpec(**fields))
    text = str(info.value)
    assert message in text and "\n" not in text
    assert text.startswith("layout")


def test_replica_groups_split_the_trainers_and_hold_data_parallel_inside() -> None:
    """layout.trainer_replicas: contiguous blocks of trainers, each a whole grid."""
    plan = plan_layout(LayoutSpec(world_size=16, trainers=8, tensor_parallel_size=2,
                                  trainer_replicas=2))
    assert plan.replicas == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert plan.replica_of(5) == (4, 5, 6, 7)
    assert plan.group("DATA_PARALLEL").rank_lists == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert plan.group("TENSOR_PARALLEL").rank_lists == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.grid_sizes == (4, 1, 2)  # data over every replica group
    assert "in 2 replica groups [0,1,2,3] | [4,5,6,7]" in format_plan(plan)
    # Without sizes, replica groups still lay a data-parallel grid inside each.
    plain = plan_layout(LayoutSpec(world_size=8, trainers=4, trainer_replicas=2))
    assert plain.group("DATA_PARALLEL").rank_lists == ((0, 1), (2, 3))
    assert plan_layout(LayoutSpec(world_size=4, trainers=2)).replicas == ((0, 1),)


def test_the_leads_replica_group_is_not_elastic() -> None:
    """Its loss takes the lead with it (the lead's own loss ends the run)."""
    import dataclasses

    plan = plan_layout(LayoutSpec(world_size=8, trainers=4, tensor_parallel_size=2,
                                  trainer_replicas=2))
    elastic = dataclasses.replace(plan, elastic_trainers=True)
    assert [elastic.is_elastic_rank(r) for r in range(4)] == [False, False, True, True]
    assert not any(plan.is_elastic_rank(r) for r in range(4))


@pytest.mark.parametrize(("spec", "message"), [
    (dict(trainers=4, trainer_replicas=0), "layout.trainer_replicas: must be a positive integer, got 0"),
    (dict(trainers=4, trainer_replicas=3), "layout.trainer_replicas: 3 does not divide the 4 trainers [0,1,2,3]"),
    (dict(trainers=4, tensor_parallel_size=2, trainer_replicas=4),
     "layout.trainer_replicas: 4 does not divide the data-parallel size 2"),
])
def test_bad_replica_groups_are_one_line(spec: dict[str, int], message: str) -> None:
    with pytest.raises(LayoutError) as err:
        plan_layout(LayoutSpec(world_size=8, **spec))  # type: ignore[arg-type]
    assert message in str(err.value) and "\n" not in str(err.value)
