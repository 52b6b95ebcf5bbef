"""The planned DATA/SEQUENCE/TENSOR_PARALLEL grid as a mesh of ranks, for
``CommContext.device_mesh``: which modes, and the row-major grid of the ranks that holds a rank
(the trainers; one replica group's with layout.trainer_replicas), checked against the plan."""

from __future__ import annotations

import math

import torch

from rlcomm.errors import LayoutError, ModeNotRegisteredError
from rlcomm.plan.layout import GRID_MODES, LayoutPlan
from rlcomm.utils import format_ranks


def default_mesh_modes(plan: LayoutPlan) -> list[str]:
    present = [m for m in GRID_MODES if plan.group(m) is not None]
    sized = [m for m in present if len(plan.group(m).rank_lists[0]) > 1]  # type: ignore[union-attr]
    return sized or present[-1:]


def _grid_of(rank: int, planned: list[set[tuple[int, ...]]]) -> list[int]:
    """The ranks of the grid that holds ``rank``: those its groups of every mode reach (the
    trainers, for the planned grid; one replica group's, with layout.trainer_replicas)."""
    reached, frontier = {rank}, {rank}
    while frontier:
        found = {r for groups in planned for group in groups if frontier & set(group)
                 for r in group} - reached
        reached |= found
        frontier = found
    return sorted(reached)


def _slices(mesh: torch.Tensor, dim: int) -> set[tuple[int, ...]]:
    """The rank lists along ``dim`` of ``mesh``: one group per combination of the other dims."""
    rows = mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim])
    return {tuple(row) for row in rows.tolist()}



def planned_mesh(plan: LayoutPlan, names: list[str], rank: int) -> torch.Tensor:
    """The global ranks of the grid that holds ``rank``, shaped by the groups of ``names``
    (outer to inner); one line naming the modes where they form no row-major grid."""
    planned: list[set[tuple[int, ...]]] = []
    for name in names:
        spec = plan.group(name)
        if spec is None:
            raise ModeNotRegisteredError(f"device_mesh: the layout plans no {name} groups")
        planned.append({tuple(sorted(g)) for g in spec.rank_lists})
    shape = [len(next(iter(groups))) for groups in planned]
    if not any(rank in group for group in planned[0]):
        raise LayoutError(f"device_mesh: rank {rank} is in none of the {', '.join(names)} groups")
    covered = _grid_of(rank, planned)
    inside = [{g for g in groups if set(g) <= set(covered)} for groups in planned]
    mesh = torch.tensor(covered).reshape(shape) if math.prod(shape) == len(covered) else None
    if mesh is None or any(_slices(mesh, d) != inside[d] for d in range(len(names))):
        raise LayoutError(
            f"device_mesh: the {', '.join(names)} groups of this layout do not form one "
            f"row-major grid of the ranks {format_ranks(covered)} (sizes {shape})"
        )
    return mesh
