"""The membership's records of growth and of leaves asked for, on a real store in this process
(torch's HashStore): a joiner beyond the plan is admitted by the leader it asked, a leave request
reaches the leader of that rank only, and a rank let go is told so; a plan takes a rollout rank
beyond it."""

from __future__ import annotations

import pytest
from torch import distributed as dist

from rlcomm import LayoutSpec, plan_layout
from rlcomm.elastic import (
    EpochRecords,
    ask_to_leave,
    let_go_epoch,
    new_rank,
    new_ranks,
    request_join,
    was_let_go,
)
from rlcomm.modes import ParallelMode

pytestmark = pytest.mark.unit


def test_a_joiner_beyond_the_plan_is_admitted_by_the_leader_it_asked_and_no_other() -> None:
    store = dist.HashStore()
    first, second = EpochRecords(store, 0, [0, 2]), EpochRecords(store, 1, [1, 3])
    assert new_rank(store, 4) == 4 and new_rank(store, 4) == 5  # never the same twice
    request_join(store, 0, 4, beyond_plan=True)
    request_join(store, 0, 7)  # not planned for rank 0, and not beyond the plan: refused
    (join,) = first.pending_joins()
    assert (join.rank, join.beyond_plan) == (4, True) and 4 in first.planned
    assert second.pending_joins() == []  # joins are asked of one leader


def test_a_leave_request_reaches_the_leader_of_that_rank_which_lets_it_go() -> None:
    store = dist.HashStore()
    first, second = EpochRecords(store, 0, [0, 2]), EpochRecords(store, 1, [1, 3])
    ask_to_leave(store, 3, "asked")
    assert first.pending_leaves() == {} and second.pending_leaves() == {3: "asked"}
    assert second.pending_leaves() == {}  # each request once
    assert let_go_epoch(store, 3) is None and not was_let_go(store, 3, 5)
    second.let_go(3)
    assert let_go_epoch(store, 3) == 1  # the next epoch is the first without it
    assert was_let_go(store, 3, 1) and not was_let_go(store, 3, 0)
    # A new process for rank 3, admitted later, is not the one that was let go.
    request_join(store, 1, 3)
    second.announce([3], second.pending_joins())
    assert let_go_epoch(store, 3) is None


def test_a_plan_takes_a_rollout_rank_beyond_it_in_its_leaders_weight_transfer_group() -> None:
    plan = plan_layout(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=[2, 3],
                                  elastic_rollouts=True))
    grown = plan.with_rollout_rank(4, leader=1)
    wt = ParallelMode.WEIGHT_TRANSFER.value
    assert grown.world_size == 5 and grown.role(4) == "rollout" and grown.is_elastic_rank(4)
    assert grown.groups_of(4)[wt][0] == 1 and grown.groups_of(3)[wt] == (*plan.groups_of(3)[wt], 4)
    assert grown.groups_of(2)[wt] == plan.groups_of(2)[wt]  # the other leader's is untouched
    assert plan.world_size == 4 and 4 not in plan.rollouts  # the plan itself is unchanged
    with pytest.raises(ValueError, match="rank 5: a rollout rank beyond the plan needs"):
        plan.with_rollout_rank(5, leader=2)


def test_a_plan_takes_a_trainer_beyond_it_in_the_trainers_group_leading_none_yet() -> None:
    plan = plan_layout(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=[2, 3],
                                  elastic_rollouts=True, elastic_trainers=True))
    grown = plan.with_trainer_rank(4)
    tdp, wt = ParallelMode.TRAIN_DATA_PARALLEL.value, ParallelMode.WEIGHT_TRANSFER.value
    assert grown.world_size == 5 and grown.role(4) == "trainer" and grown.is_elastic_rank(4)
    assert grown.groups_of(4)[tdp] == (0, 1, 4) and grown.groups_of(4)[wt] == (4,)
    assert grown.groups_of(2)[wt] == plan.groups_of(2)[wt]  # the planned leaders keep theirs
    # A rollout rank that joins after it may go to it.
    assert grown.with_rollout_rank(5, leader=4).groups_of(5)[wt] == (4, 5)
    static = plan_layout(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=[2, 3],
                                    elastic_rollouts=True))
    with pytest.raises(ValueError, match="rank 4: a trainer beyond the plan needs elastic"):
        static.with_trainer_rank(4)


def test_a_joiner_asks_the_trainer_leading_the_fewest_and_tied_joiners_spread() -> None:
    from app.join import least_led

    store = dist.HashStore()
    EpochRecords(store, 0, [0, 2, 4]), EpochRecords(store, 1, [1, 3]), EpochRecords(store, 5, [5])
    assert least_led(store, [0, 1, 5], 6) == 5 and least_led(store, [0, 1, 5], 7) == 5
    tied = dist.HashStore()
    EpochRecords(tied, 0, [0, 2]), EpochRecords(tied, 1, [1, 3])
    # Two trainers leading as many: joiners 4 and 5, started together, ask one each.
    assert [least_led(tied, [0, 1], rank) for rank in (4, 5)] == [0, 1]



def test_a_plan_takes_a_replica_group_beyond_it_with_the_first_groups_grid_laid_over_it() -> None:
    store = dist.HashStore()
    assert new_rank(store, 8) == 8 and new_ranks(store, 8, 2) == [9, 10]  # consecutive, fresh
    plan = plan_layout(LayoutSpec(world_size=8, trainers=4, tensor_parallel_size=2,
                                  trainer_replicas=2, elastic_rollouts=True,
                                  elastic_trainers=True))
    grown = plan.with_replica_group([9, 10])
    tp, tdp = ParallelMode.TENSOR_PARALLEL.value, ParallelMode.TRAIN_DATA_PARALLEL.value
    assert grown.replicas == (*plan.replicas, (9, 10)) and grown.trainer_replicas == 3
    assert grown.groups_of(9)[tp] == (9, 10) and grown.groups_of(9)[tdp][-2:] == (9, 10)
    assert grown.groups_of(0)[tp] == plan.groups_of(0)[tp]
    with pytest.raises(ValueError, match=r"ranks \[9\]: a replica group beyond the plan needs"):
        plan.with_replica_group([9])
