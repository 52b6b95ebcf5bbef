"""The results table (terminal and Markdown) and ``results.json``."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .core import BYTES, PER_SECOND, SECONDS, Row, Stat

HEADER = ("section", "comparison", "rlcomm", "reference", "ratio", "goal", "met")


def format_value(value: float, unit: str) -> str:
    if unit == SECONDS:
        if value < 1e-3:
            return f"{value * 1e6:.1f} us"
        return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.2f} s"
    if unit == BYTES:
        return f"{value / 2**20:.1f} MiB"
    if unit == PER_SECOND:
        return f"{value:,.0f}/s"
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return f"{text} {unit}".rstrip()


def format_stat(stat: Stat | None, unit: str, spread: bool = True) -> str:
    if stat is None:
        return "-"
    text = format_value(stat.median, unit)
    if spread and stat.n > 1:
        text += f" [{format_value(stat.min, unit)}..{format_value(stat.max, unit)}]"
    return text


def cells(row: Row) -> list[str]:
    rlcomm = format_stat(row.rlcomm, row.unit, spread=False)
    reference = format_stat(row.reference, row.unit, spread=False)
    gbps = row.extra.get("rlcomm_GBps"), row.extra.get("reference_GBps")
    if gbps[0] is not None and gbps[1] is not None:
        rlcomm += f" ({gbps[0]:.2f} GB/s)"
        reference += f" ({gbps[1]:.2f} GB/s)"
    if row.status != "ok":
        rlcomm, reference = row.status, "(see notes)"
    ratio = "-"
    if row.ratio is not None:
        ratio = f"{row.ratio.median:.3f} [{row.ratio.min:.2f}..{row.ratio.max:.2f}]"
        if row.ratio.q1 is not None and row.ratio.q3 is not None:
            ratio += f" IQR {row.ratio.q1:.2f}..{row.ratio.q3:.2f}"
    goal = row.goal.describe(row.unit) if row.goal else "-"
    return [row.section, row.name, rlcomm, reference, ratio, goal, row.met]


def table(rows: Sequence[Row]) -> str:
    """A plain-text table, one line per row (the ratio shows median [min..max])."""
    lines = [list(HEADER), *[cells(row) for row in rows]]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out += [
        f"  {row.status}: {row.section} / {row.name}: {row.note}"
        for row in rows
        if row.status != "ok"
    ]
    return "\n".join(out)


def markdown(rows: Sequence[Row], meta: dict[str, Any]) -> str:
    lines = [
        "# rlcomm benchmarks",
        "",
        ", ".join(f"{k}: {v}" for k, v in meta.items() if not isinstance(v, (dict, list))),
        "",
        "Ratio = rlcomm / reference per repetition (time, or memory), median [min..max] and "
        "interquartile range; values are medians. A goal marked (IQR) is met only when the "
        "whole interquartile range is inside it.",
        "",
        "| " + " | ".join(HEADER) + " | note |",
        "|" + "---|" * (len(HEADER) + 1),
    ]
    for row in rows:
        values = [c.replace("|", "\\|") for c in [*cells(row), row.note]]
        lines.append("| " + " | ".join(values) + " |")
    missed = [f"- {r.section}: {r.name}" for r in rows if r.met == "no"]
    lines += ["", "## Goals missed", "", *(missed or ["none"]), ""]
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cuda_devices": torch.cuda.device_count(),
    }


def write(rows: Sequence[Row], meta: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {**meta, "rows": [row.as_dict() for row in rows]}
    (out_dir / "results.json").write_text(json.dumps(document, indent=2))
    (out_dir / "results.md").write_text(markdown(rows, meta))
