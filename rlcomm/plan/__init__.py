"""Layout planning, pure Python: :mod:`.spec` (what a user declares), :mod:`.ranks` (rank lists,
counts and ranges, checked) and :mod:`.layout` (the planner: every group of every rank)."""

from rlcomm.plan.layout import (
    GroupSpec,
    LayoutPlan,
    LayoutSpec,
    RankSelection,
    format_plan,
    grid_groups,
    place_on_hosts,
    plan_layout,
)

__all__ = [
    "GroupSpec",
    "LayoutPlan",
    "LayoutSpec",
    "RankSelection",
    "format_plan",
    "grid_groups",
    "place_on_hosts",
    "plan_layout",
]
