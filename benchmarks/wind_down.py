"""5b. Wind-down: from a run's stop decision to its process's exit, over short default runs
(apprun.SHORT_RUN, shared with the start-up rows), as the run recorded it and as its exit was
seen: stop decision -> result.json (the last checkpoint, the learning curve, the closing
collectives and teardown), result.json -> exit (the ranks' and the launcher's exit), and the
two together. Goal: the process exits within 0.5 s of result.json in every run (20 of 20).
"""

from __future__ import annotations

from collections.abc import Callable

from .apprun import AppRun, short_runs
from .core import Goal, Row, Settings, Stat

NAME = "wind_down"
RUNS = {"full": 20, "quick": 5}
EXIT_GOAL = Goal("<=", 0.5, on="max")


def run(settings: Settings) -> list[Row]:
    wanted = RUNS["quick" if settings.quick else "full"]
    runs, note = short_runs(settings, wanted)
    runs = runs[:wanted]
    finished = [r for r in runs if r.result is not None]
    failed = [r.problem for r in runs if r.problem]
    if not finished:
        why = failed[0] if failed else note or "no run"
        return [Row(NAME, "default run wind-down", status="failed", note=why)]
    common = "; ".join(filter(None, [f"{len(finished)} of {wanted} short default runs", note,
                                     f"{len(failed)} failed: {failed[0]}" if failed else ""]))

    def stop_to_result(r: AppRun) -> float | None:
        return r.phases.get("stop_to_result_s")

    measures: list[tuple[str, Callable[[AppRun], float | None], Goal | None]] = [
        ("stop decision -> result.json", stop_to_result, None),
        ("result.json -> process exit", AppRun.result_to_exit_s, EXIT_GOAL),
        ("stop decision -> process exit", AppRun.stop_to_exit_s, None),
    ]
    rows = []
    for label, measure, goal in measures:
        values = [v for r in finished if (v := measure(r)) is not None]
        row = Row(NAME, f"default run wind-down: {label}", goal=goal, note=common)
        if values:
            row.rlcomm = Stat.of(values)
            if goal is not None:
                met = sum(v <= goal.threshold for v in values)
                row.note = f"{met} of {len(values)} within {goal.threshold:g} s; {common}"
                if len(values) < wanted:  # every run must be in for "20 of 20"
                    row.status = "failed" if failed else "skipped"
        else:
            row.status, row.note = "skipped", f"no marks for it in result.json; {common}"
        rows.append(row)
    return rows
