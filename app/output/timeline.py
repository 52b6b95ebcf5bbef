"""When a run reached each step: wall-clock times (``time.time()``) the run records as it goes,
so that start-up and wind-down can be read as phases from ``result.json`` instead of guessed.

The launching process marks ``start`` (its own start, or the job's in a sweep), ``composed``
(Hydra done) and ``validated`` (the plan checked, ranks about to start) and hands them to its
ranks through
:data:`ENV`; each rank marks ``started`` (its code runs), ``groups`` (every planned group
exists), ``loop`` (the loop is called), ``first_update`` and ``stop`` (the loop's first update
and its stop decision, marked by the loop) and ``finished`` (the loop returned); rank 0 marks
``result`` just before it writes ``result.json``. :func:`phases` turns them into the numbers
the benchmarks report (docs/benchmarks.md, "startup" and "wind-down").
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

ENV = "RLCOMM_TIMELINE"  # the launching process's marks, as JSON, for its ranks

_marks: dict[str, float] = {}


def mark(name: str, at: float | None = None) -> float:
    """Records ``name`` at ``at`` (default: now) unless it was recorded already: the first time
    wins (a loop may mark ``first_update`` on every update). Returns the recorded time."""
    return _marks.setdefault(name, time.time() if at is None else at)


def marks() -> dict[str, float]:
    """This process's marks so far."""
    return dict(_marks)


def reset() -> None:
    """Forgets every mark (a sweep's next job in the same process starts afresh)."""
    _marks.clear()


def process_start_time(pid: int | None = None) -> float:
    """When process ``pid`` (default: this one) was created, from /proc (to 10 ms); the time
    now where /proc cannot tell."""
    try:
        stat = open(f"/proc/{pid or os.getpid()}/stat").read()  # noqa: SIM115
        ticks = int(stat.rpartition(")")[2].split()[19])
        # The boot time from the clock /proc counts in, not /proc/stat's btime: that is cut to
        # whole seconds, which would move every start by up to a second.
        booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def export() -> None:
    """Hands this process's marks to the ranks it starts (through the environment)."""
    os.environ[ENV] = json.dumps(_marks)


def launcher_marks(environ: Mapping[str, str] | None = None) -> dict[str, float]:
    """The marks the launching process handed over (empty where there were none)."""
    raw = (os.environ if environ is None else environ).get(ENV)
    if not raw:
        return {}
    try:
        found = json.loads(raw)
    except ValueError:
        return {}
    return {k: float(v) for k, v in found.items() if isinstance(v, (int, float))}


def phases(timeline: Mapping[str, Any]) -> dict[str, float | None]:
    """Seconds per phase from a run's ``timeline`` (result.json): one after the other, so
    together they cover launch to ``result.json``. A phase whose marks are missing is None.

    - ``compose_validate_s``: process start to the validated plan (Python, imports, Hydra);
    - ``spawn_import_s``: to the last rank running its code (starting processes, imports);
    - ``rendezvous_groups_s``: to the last rank holding every planned group;
    - ``first_update_s``: to the loop's first update on every rank (building the loop,
      environments, the first rollout and update);
    - ``training_s``: to the stop decision (the first rank's);
    - ``stop_to_result_s``: to ``result.json`` (last checkpoint, learning curve, teardown).
    """
    ranks: Mapping[str, Mapping[str, float]] = timeline.get("ranks") or {}

    def latest(name: str) -> float | None:
        found = [r[name] for r in ranks.values() if name in r]
        return max(found) if found else None

    stops = [r["stop"] for r in ranks.values() if "stop" in r]
    points = [
        ("compose_validate_s", timeline.get("start"), timeline.get("validated")),
        ("spawn_import_s", timeline.get("validated"), latest("started")),
        ("rendezvous_groups_s", latest("started"), latest("groups")),
        ("first_update_s", latest("groups"), latest("first_update")),
        ("training_s", latest("first_update"), min(stops) if stops else None),
        ("stop_to_result_s", min(stops) if stops else None, timeline.get("result")),
    ]
    return {
        name: round(end - begin, 3) if begin is not None and end is not None else None
        for name, begin, end in points
    }
