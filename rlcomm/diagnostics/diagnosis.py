"""From every rank's progress report to one line naming a hang (pure functions, no torch).

A report (built by :mod:`rlcomm.diagnostics.watchdog`) is plain data: ``{"rank", "groups": {mode: declared
ranks}, "modes": {mode: {"entered", "completed", "calls": [call records]}}, "where": "file:line
in function" of the main thread}``; a rank that did not answer has ``None``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rlcomm.diagnostics.recorder import format_call
from rlcomm.utils import format_ranks

Report = dict[str, Any]


def _signature(call: dict[str, Any]) -> tuple[Any, ...]:
    return call["op"], call["dtype"], tuple(call["shape"]), call["peer"]


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"


def root_call(reports: dict[int, Report | None]) -> tuple[int, dict[str, Any]] | None:
    """The collective the hang started in: the oldest call still in flight on any rank (ranks
    stuck behind it, in other modes, are its consequence); ties go to the lowest rank."""
    oldest: tuple[float, int, dict[str, Any]] | None = None
    for rank, report in reports.items():
        if report is None:
            continue
        for table in report["modes"].values():
            for call in table["calls"]:
                key = (call["started_wall"], rank, call)
                if call["in_flight"] and (oldest is None or key[:2] < oldest[:2]):
                    oldest = key
    return None if oldest is None else (oldest[1], oldest[2])


def where_is(report: Report) -> str:
    """``rank 2 is in TRAIN_DATA_PARALLEL all_reduce #118 (...)`` or in user code."""
    rank = report["rank"]
    busy = [c for t in report["modes"].values() for c in t["calls"] if c["in_flight"]]
    if busy:
        call = min(busy, key=lambda c: c["started_wall"])
        return f"rank {rank} is in {call['mode']} {format_call(call)}"
    where = report.get("where") or "an unknown place"
    return f"rank {rank} is in user code at {where} (its Python stack is in its log)"


def diagnose(reports: dict[int, Report | None]) -> str:
    """One line: the hung collective (mode, group, op, sequence number, size, caller) and why
    it cannot complete: members that never entered it (and where they are instead), members
    that entered something else at that sequence number, members that did not answer."""
    found = root_call(reports)
    if found is None:
        return ""
    root_rank, root = found
    mode, seq = root["mode"], root["seq"]
    declared = reports[root_rank]["groups"][mode]  # type: ignore[index]
    members = sorted(declared)
    never, gone, calls = _where_members_are(reports, members, mode, seq)
    by_signature: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for rank, call in sorted(calls.items()):
        by_signature[_signature(call)].append(rank)
    # The majority's call names the collective (ties: the lowest rank's); the rest mismatch.
    reference = max(by_signature.items(), key=lambda kv: (len(kv[1]), -kv[1][0]), default=None)
    head_call = calls[reference[1][0]] if reference else root
    problems: list[str] = []
    for rank in never:
        report = reports[rank]
        assert report is not None
        problems.append(f"rank {rank} never entered it; {where_is(report)}")
    for signature, ranks in by_signature.items():
        if reference is not None and signature != reference[0]:
            other = calls[ranks[0]]
            problems.append(f"mismatch: {_who(ranks)} called {format_call(other)} instead")
    if gone:
        problems.append(f"{_who(gone)} did not answer (process gone or host unreachable)")
    if not problems:
        waiting = [r for r in members if calls.get(r, {}).get("in_flight")]
        problems.append(
            f"{_who(waiting)} of {len(members)} are in it with the same arguments and none "
            "is missing (a slow rank or a stalled network?)"
        )
    return f"hang in {mode}{format_ranks(declared)} {format_call(head_call)}: {'; '.join(problems)}"


def _where_members_are(
    reports: dict[int, Report | None], members: list[int], mode: str, seq: int,
) -> tuple[list[int], list[int], dict[int, dict[str, Any]]]:
    """Of the group's ``members``: those that never entered call ``seq`` of ``mode``, those
    that did not answer, and the call each of the others made at that sequence number."""
    never: list[int] = []
    gone: list[int] = []
    calls: dict[int, dict[str, Any]] = {}
    for rank in members:
        report = reports.get(rank)
        if report is None:
            gone.append(rank)
            continue
        table = report["modes"].get(mode, {"entered": 0, "calls": []})
        if table["entered"] < seq:
            never.append(rank)
            continue
        call = next((c for c in table["calls"] if c["seq"] == seq), None)
        if call is not None:
            calls[rank] = call
    return never, gone, calls
