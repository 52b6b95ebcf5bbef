"""Which way each figure of ``result.json["metrics"]`` is better, and what a sweep ranks by.

Each loop declares the figures it reports on its class (``metrics``, an
:class:`app.api.LoopMetrics`); the app declares the ones it adds to every job
(:data:`APP_METRICS`, app/launch/rank.py). ``sweep.rank_by`` is checked against the configured
loop's and the app's before any job starts (app/launch/planning.py), and the sweep report
ranks by it (app/sweep/). Both read this catalogue, so neither imports the other. Per-group
figures are named ``<metric>:<group>``, e.g. commcheck's ``latency_us:WEIGHT_TRANSFER[0,2]``;
their direction is the base name's.
"""

from __future__ import annotations

import importlib

from app.api import Direction, LoopHooks, LoopMetrics
from app.errors import ConfigError

APP_METRICS = LoopMetrics(
    {
        "startup_s": "min",  # job start to the first collective (rendezvous done), rank 0
        "group_creation_s": "min",  # creating every planned group, rank 0
        "wall_s": "min",  # job start to result.json written
    },
    headline=("wall_s", "startup_s"),  # a loop that names no headline of its own
)


def declared_metrics(loop_target: str | None) -> LoopMetrics | None:
    """What the loop ``_target_`` declares as its ``metrics`` (empty when it declares none);
    None when the target cannot be imported here."""
    if not loop_target:
        return None
    module_name, _, attr = str(loop_target).rpartition(".")
    try:
        loop = getattr(importlib.import_module(module_name), attr)
    except Exception:  # a plugin's own import error is the loop's to report, not the sweep's
        return None
    return LoopHooks(loop).metrics


def known_metrics(*loop_targets: str | None) -> dict[str, Direction]:
    """Every figure the loops at ``loop_targets`` or the app report, with its direction."""
    known: dict[str, Direction] = {}
    for target in loop_targets:
        declared = declared_metrics(target)
        if declared is not None:
            known.update(declared.directions)
    return {**known, **APP_METRICS.directions}


def direction(name: str, *loop_targets: str | None) -> Direction:
    """``"min"`` when lower is better, ``"max"`` when higher is; KeyError for unknown names."""
    return known_metrics(*loop_targets)[name.split(":", 1)[0]]


def check_metric_name(name: str, *loop_targets: str | None, where: str = "sweep.rank_by") -> None:
    """One-line error for a metric that neither these loops nor the app report."""
    known = known_metrics(*loop_targets)
    if name.split(":", 1)[0] not in known:
        raise ConfigError(f"{where}: unknown metric {name!r}; known: {', '.join(sorted(known))}")


def headline(loop_target: str | None) -> tuple[str, ...]:
    """The sweep table's columns for this loop: its own headline, else the app's."""
    declared = declared_metrics(loop_target)
    return (declared.headline if declared is not None else ()) or APP_METRICS.headline


def default_rank_by(loop_target: str | None) -> str:
    """What a sweep of this loop ranks by when ``sweep.rank_by`` is not set."""
    return headline(loop_target)[0]
