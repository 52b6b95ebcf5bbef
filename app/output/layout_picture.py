"""A picture of a layout plan: nodes as boxes, each rank with its role, one band per mode in
which each group is a coloured span over its ranks, so the eye sees who talks to whom.

:func:`describe_layout` decides what is drawn (pure, testable); :func:`draw_layout` draws exactly
that. Large layouts are summarised: a few nodes in full (the first ones and the last), a few
ranks per node, the rest counted, so drawing costs the same at 4 and at 65,536 ranks.
matplotlib is imported only when drawing (``plan_only`` and the launcher import this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlcomm import LayoutPlan, format_plan

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MAX_NODES = 4  # nodes drawn in full: the first MAX_NODES - 1 and the last
MAX_RANKS_PER_NODE = 8  # ranks drawn per node: the first MAX_RANKS_PER_NODE - 1 and the last
# matplotlib's "tab10" colours, one per group (cycled).
TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
         "#bcbd22", "#17becf")
ROLE_COLORS = {
    "trainer": "#d62728",
    "rollout": "#1f77b4",
    "trainer+rollout": "#9467bd",
    "replay": "#2ca02c",  # layout.replay (docs/off-policy.md)
    "idle": "#bbbbbb",
}


@dataclass(frozen=True)
class RankCell:
    rank: int
    role: str
    x: float  # column centre


@dataclass(frozen=True)
class NodeBox:
    node: int
    cells: tuple[RankCell, ...]
    hidden_ranks: int  # ranks of this node not drawn


@dataclass(frozen=True)
class Span:
    """One group as drawn: its index in the mode, its drawn members, and its full size."""

    group: int
    ranks: tuple[int, ...]
    size: int


@dataclass(frozen=True)
class Band:
    mode: str
    groups: int  # groups of this mode in the whole plan
    spans: tuple[Span, ...]  # those with at least one drawn rank


@dataclass(frozen=True)
class LayoutPicture:
    """What :func:`draw_layout` draws."""

    world_size: int
    nodes: int
    ranks_per_node: int
    boxes: tuple[NodeBox, ...]
    hidden_nodes: int  # nodes not drawn (their count is written between the boxes)
    hidden_ranks: int  # ranks not drawn, hidden nodes included
    bands: tuple[Band, ...]

    @property
    def cells(self) -> tuple[RankCell, ...]:
        return tuple(cell for box in self.boxes for cell in box.cells)

    def column(self, rank: int) -> float:
        return next(cell.x for cell in self.cells if cell.rank == rank)


def describe_layout(
    plan: LayoutPlan, max_nodes: int = MAX_NODES, max_ranks_per_node: int = MAX_RANKS_PER_NODE
) -> LayoutPicture:
    """Which nodes, ranks and group spans to draw, and where."""
    per_node = plan.ranks_per_node
    shown_nodes = _ends(plan.nodes, max_nodes)
    boxes, x = [], 0.0
    for position, node in enumerate(shown_nodes):
        if position and node != shown_nodes[position - 1] + 1:
            x += 1.0  # room for "... N nodes"
        local = _ends(per_node, max_ranks_per_node)
        cells = []
        for i, offset in enumerate(local):
            if i and offset != local[i - 1] + 1:
                x += 0.6  # room for "..."
            rank = node * per_node + offset
            cells.append(RankCell(rank, plan.role(rank), x))
            x += 1.0
        boxes.append(NodeBox(node, tuple(cells), per_node - len(local)))
        x += 0.4  # gap between node boxes
    drawn = {cell.rank for box in boxes for cell in box.cells}
    bands = []
    for spec in plan.groups:
        spans = []
        for index, ranks in enumerate(spec.rank_lists):
            members = drawn.intersection(ranks)
            if members:
                spans.append(Span(index, tuple(sorted(members)), len(ranks)))
        bands.append(Band(spec.mode, len(spec.rank_lists), tuple(spans)))
    return LayoutPicture(
        world_size=plan.world_size,
        nodes=plan.nodes,
        ranks_per_node=per_node,
        boxes=tuple(boxes),
        hidden_nodes=plan.nodes - len(shown_nodes),
        hidden_ranks=plan.world_size - len(drawn),
        bands=tuple(bands),
    )


def draw_layout(picture: LayoutPicture, png: Path) -> None:
    """Draws ``picture`` into ``png`` (matplotlib, Agg). Boxes go into one collection per kind
    and there is no layout pass: drawing costs a fraction of a second at any world size."""
    # A bare Figure on the Agg canvas: pyplot's import and its figure manager would add a
    # third to what drawing costs, and plan_only's start-up is mostly this picture.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection, PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    cells = picture.cells
    width = max(cell.x for cell in cells) + 1.0
    rows = len(picture.bands)
    fig = Figure(figsize=(min(3.0 + 0.55 * width, 24.0), 1.6 + 0.45 * (rows + 3)))
    FigureCanvasAgg(fig)
    label_room = 2.4 / fig.get_figwidth()  # mode names left of the bands
    ax = fig.add_axes((label_room, 0.02, 1 - label_room - 0.01, 0.9))
    palette = TAB10
    node_y = rows + 0.6  # bands occupy y = 0 .. rows - 1, nodes sit above them
    _draw_nodes(ax, picture, node_y)
    columns = {cell.rank: cell.x for cell in cells}
    boxes, colors, links, link_colors = [], [], [], []
    for row, band in enumerate(picture.bands):
        y = rows - 1 - row
        for span in band.spans:
            color = palette[span.group % len(palette)]
            xs = [columns[r] for r in span.ranks]
            lane = y + 0.15 * (span.group % 3 - 1)  # interleaved groups get separate lines
            links.append([(min(xs), lane), (max(xs), lane)])
            link_colors.append(color)
            for px in xs:
                boxes.append(Rectangle((px - 0.42, y - 0.3), 0.84, 0.6))
                colors.append(color)
            more = f"/{span.size}" if span.size > len(span.ranks) else ""
            ax.text(min(xs) - 0.38, y, f"g{span.group}{more}", fontsize=6, va="center",
                    ha="left", color="white")
        ax.text(-0.7, y, f"{band.mode} ({band.groups})", ha="right", va="center", fontsize=8)
    ax.add_collection(LineCollection(links, colors=link_colors, linewidths=2, alpha=0.6))
    ax.add_collection(PatchCollection(boxes, facecolors=colors, alpha=0.85, linewidths=0))
    title = (f"world_size={picture.world_size}, {picture.nodes} node(s) x "
             f"{picture.ranks_per_node} ranks")
    if picture.hidden_ranks:
        title += f"; {picture.hidden_ranks:,} ranks not drawn"
    ax.set_title(title, fontsize=9)
    ax.set_xlim(-0.8, width)
    ax.set_ylim(-0.7, node_y + 1.3)
    ax.axis("off")
    # Written aside and renamed: a drawing stopped halfway leaves no cut picture behind.
    partial = png.with_name(f".{png.name}.partial")
    try:
        fig.savefig(partial, dpi=100, format="png")
        partial.replace(png)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def write_layout_files(plan: LayoutPlan, run_dir: Path) -> Path:
    """``layout.png`` and ``layout.txt`` (the printed table) in ``run_dir``; returns the png."""
    write_layout_text(plan, run_dir)
    return draw_layout_file(describe_layout(plan), run_dir / "layout.png")


def write_layout_text(plan: LayoutPlan, run_dir: Path) -> Path:
    """``layout.txt``, the printed table, in ``run_dir`` (a full disk: the error names it)."""
    from app.errors import naming

    run_dir.mkdir(parents=True, exist_ok=True)
    text = run_dir / "layout.txt"
    with naming(text):
        text.write_text(format_plan(plan) + "\n")
    return text


def draw_layout_file(picture: LayoutPicture, png: Path) -> Path:
    """:func:`draw_layout` into ``png`` (a full disk: the error names it); returns ``png``.
    What the launcher hands to its picture service or to a process of its own (app/__main__.py):
    a picture is small to pass, whatever the plan's size."""
    from app.errors import naming

    with naming(png):
        draw_layout(picture, png)
    return png


def _draw_nodes(ax: Axes, picture: LayoutPicture, y: float) -> None:
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    frames, cells, colors = [], [], []
    previous: NodeBox | None = None
    for box in picture.boxes:
        left, right = box.cells[0].x - 0.5, box.cells[-1].x + 0.5
        if previous is not None and box.node != previous.node + 1:
            skipped = box.node - previous.node - 1
            ax.text(left - 0.7, y, f"...\n{skipped:,}\nnodes", ha="center", va="center", fontsize=6)
        frames.append(Rectangle((left, y - 0.45), right - left, 1.25))
        ax.text(left + 0.05, y + 0.62, f"node {box.node}", fontsize=7, va="center")
        for i, cell in enumerate(box.cells):
            if i and cell.rank != box.cells[i - 1].rank + 1:
                ax.text(cell.x - 0.8, y, "...", ha="center", va="center", fontsize=7)
            cells.append(Rectangle((cell.x - 0.45, y - 0.35), 0.9, 0.7))
            colors.append(ROLE_COLORS.get(cell.role, ROLE_COLORS["idle"]))
            role = cell.role.replace("trainer+rollout", "tr+ro")
            ax.text(cell.x, y, f"{cell.rank}\n{role}", ha="center", va="center", fontsize=6,
                    color="white")
        previous = box
    ax.add_collection(PatchCollection(frames, facecolors="none", edgecolors="black"))
    ax.add_collection(PatchCollection(cells, facecolors=colors, linewidths=0))


def _ends(count: int, limit: int) -> list[int]:
    """``range(count)``, or its first ``limit - 1`` items and the last one when longer."""
    if count <= limit:
        return list(range(count))
    return [*range(limit - 1), count - 1]
