"""One name, one meaning: what renaming the modes and initializers must keep.

The original CommContext's methods keep their names, argument names and defaults; its three
initializers keep working by name without a mode; every shipped mode is built by one of the two
parametrised initializers under its own name.
"""

from __future__ import annotations

import inspect

import pytest

from rlcomm import CommContext, CommMode, ParallelMode
from rlcomm.group_initializer import (
    GroupInitializer,
    IntraNodeGroupInitializer,
    SizeGroupInitializer,
    TrainDPGroupInitializer,
    WeightTransferGroupInitializer,
    get_initializer,
)

pytestmark = pytest.mark.unit

# The original API page's methods: positional parameters (name, default) after ``self``.
EMPTY = inspect.Parameter.empty
SEED_METHODS: dict[str, list[tuple[str, object]]] = {
    "is_initialized": [],
    "init_distributed_env": [("world_size", None), ("rank", None), ("backend", "nccl"),
                             ("dist_url", "env://"), ("timeout", 1800)],
    "get_group": [("comm_mode", EMPTY)],
    "get_world_size": [("comm_mode", EMPTY)],
    "get_global_rank": [],
    "get_local_rank": [("comm_mode", EMPTY)],
    "get_in_node_rank": [],
    "get_ranks_in_group": [("comm_mode", EMPTY)],
    "get_local_world_size": [],
    "get_intra_node_process_group": [],
    "get_inter_node_process_group": [],
    "is_main_rank": [],
    "init_group": [("ranks", EMPTY), ("mode", None), ("backend", "nccl"), ("use_cpu", False)],
    "destroy": [],
}


@pytest.mark.parametrize("name", sorted(SEED_METHODS))
def test_the_original_methods_keep_their_names_arguments_and_defaults(name: str) -> None:
    params = list(inspect.signature(getattr(CommContext, name)).parameters.values())[1:]
    positional = [(p.name, p.default) for p in params
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    expected = SEED_METHODS[name]
    assert positional[: len(expected)] == expected
    # Whatever was added after them has a default: the original calls still work.
    assert all(p.default is not EMPTY for p in params[len(expected):])


@pytest.mark.parametrize(("cls", "mode"), [
    (TrainDPGroupInitializer, "TRAIN_DATA_PARALLEL"),
    (IntraNodeGroupInitializer, "INTRA_NODE"),
    (WeightTransferGroupInitializer, "WEIGHT_TRANSFER"),
])
def test_the_original_initializers_work_by_name_without_a_mode(
    cls: type[GroupInitializer], mode: str
) -> None:
    initializer = cls(0, 4, [[0, 2], [1, 3]])  # the original CommContext's call
    assert initializer.mode_name == mode
    assert [list(g) for g in initializer.rank_lists()] == [[0, 2], [1, 3]]


@pytest.mark.parametrize(("mode", "cls"), [
    (ParallelMode.TRAIN_DATA_PARALLEL, GroupInitializer),
    (CommMode.INTRA_NODE, GroupInitializer),
    (CommMode.INTER_NODE, GroupInitializer),
    (ParallelMode.WEIGHT_TRANSFER, GroupInitializer),
    (ParallelMode.TENSOR_PARALLEL, SizeGroupInitializer),
    (ParallelMode.SEQUENCE_PARALLEL, SizeGroupInitializer),
    (ParallelMode.DATA_PARALLEL, SizeGroupInitializer),
])
def test_every_shipped_mode_is_built_by_a_parametrised_initializer(
    mode: ParallelMode | CommMode, cls: type[GroupInitializer]
) -> None:
    assert get_initializer(mode) is cls
    initializer = get_initializer(mode)(0, 4, [0, 1, 2, 3], mode=mode, group_size=2,
                                        tensor_parallel_size=1)
    assert initializer.mode_name == mode.value
    assert len(initializer.rank_lists()) == (2 if cls is SizeGroupInitializer else 1)


def test_a_mode_without_an_initializer_is_named() -> None:
    with pytest.raises(NotImplementedError, match="Parallel mode None is not supported"):
        get_initializer(None)
