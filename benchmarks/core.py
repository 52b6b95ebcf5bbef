"""What every comparison shares: statistics, goals, result rows and the interleaved timer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Units a value can have; the report formats each its own way.
SECONDS, BYTES, PER_SECOND, NUMBER = "s", "B", "/s", ""


@dataclass(frozen=True)
class Stat:
    """Median, min and max of repeated samples, and their quartiles (the interquartile range)."""

    median: float
    min: float
    max: float
    n: int
    q1: float | None = None
    q3: float | None = None

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stat:
        if not samples:
            raise ValueError("no samples")
        q1 = q3 = None
        if len(samples) >= 4:
            q1, _, q3 = statistics.quantiles(samples, n=4)
        return cls(
            statistics.median(samples), min(samples), max(samples), len(samples), q1, q3
        )

    @classmethod
    def single(cls, value: float) -> Stat:
        return cls(value, value, value, 1)

    def as_dict(self) -> dict[str, float]:
        quartiles: dict[str, float] = {}
        if self.q1 is not None and self.q3 is not None:
            quartiles = {"q1": self.q1, "q3": self.q3}
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n, **quartiles}


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Stat:
    """Per-repetition ratios (sample i of one side over sample i of the other, measured next to
    each other), so drift between repetitions cancels."""
    return Stat.of([a / b for a, b in zip(numerators, denominators, strict=True)])


@dataclass(frozen=True)
class Goal:
    """A threshold on the median ratio (``on="ratio"``), on rlcomm's median value
    (``on="value"``) or on rlcomm's largest value, so that every sample must meet it
    (``on="max"``)."""

    op: str  # "<=", "<" or ">="
    threshold: float
    on: str = "ratio"
    # Met only when the whole interquartile range is inside the goal, not just the median
    # (the far quartile is compared), so a run that merely straddles it does not pass.
    whole_iqr: bool = False

    def met(self, row: Row) -> bool | None:
        stat = row.ratio if self.on == "ratio" else row.rlcomm
        if stat is None:
            return None
        value = stat.max if self.on == "max" else stat.median
        if self.whole_iqr and stat.q1 is not None and stat.q3 is not None:
            value = stat.q1 if self.op == ">=" else stat.q3
        if self.op == "<=":
            return value <= self.threshold
        if self.op == "<":
            return value < self.threshold
        return value >= self.threshold

    def describe(self, unit: str) -> str:
        if self.on == "ratio":
            return f"ratio {self.op} {self.threshold:.3g}" + (" (IQR)" if self.whole_iqr else "")
        which = "every value" if self.on == "max" else "value"
        return f"{which} {self.op} {self.threshold:g} {unit}".rstrip()


@dataclass
class Row:
    """One comparison: rlcomm's value, its reference's, their ratio and the goal."""

    section: str
    name: str
    unit: str = SECONDS
    rlcomm: Stat | None = None
    reference: Stat | None = None
    ratio: Stat | None = None
    goal: Goal | None = None
    reference_name: str = ""
    note: str = ""
    status: str = "ok"  # "ok", "skipped", "timeout" or "failed"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def met(self) -> str:
        if self.status != "ok":
            return self.status
        if self.goal is None:
            return "-"
        verdict = self.goal.met(self)
        return "-" if verdict is None else ("yes" if verdict else "no")

    def set_per_seed(self, ours: Sequence[float | None],
                     reference: Sequence[float | None]) -> None:
        """``rlcomm``, ``reference`` and their per-seed ``ratio`` from one value per seed of
        each side (None: that run failed); ``failed`` when no seed has both."""
        if any(v is not None for v in ours):
            self.rlcomm = Stat.of([v for v in ours if v is not None])
        if any(v is not None for v in reference):
            self.reference = Stat.of([v for v in reference if v is not None])
        paired = [(a, b) for a, b in zip(ours, reference, strict=True) if a is not None and b]
        if paired:
            self.ratio = ratios([a for a, _ in paired], [b for _, b in paired])
        else:
            self.status = "failed"

    def as_dict(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "name": self.name,
            "reference_name": self.reference_name,
            "unit": self.unit,
            "rlcomm": self.rlcomm.as_dict() if self.rlcomm else None,
            "reference": self.reference.as_dict() if self.reference else None,
            "ratio": self.ratio.as_dict() if self.ratio else None,
            "goal": self.goal.describe(self.unit) if self.goal else None,
            "met": self.met,
            "status": self.status,
            "note": self.note,
            "extra": self.extra,
        }


def compare(
    section: str,
    name: str,
    samples: Mapping[str, Sequence[float]],
    rlcomm: str,
    reference: str,
    goal: Goal | None = None,
    unit: str = SECONDS,
    note: str = "",
) -> Row:
    """The row for ``samples[rlcomm]`` against ``samples[reference]`` (paired repetitions)."""
    ours, theirs = Stat.of(samples[rlcomm]), Stat.of(samples[reference])
    return Row(
        section,
        name,
        unit=unit,
        rlcomm=ours,
        reference=theirs,
        ratio=ratios(samples[rlcomm], samples[reference]),
        goal=goal,
        reference_name=reference,
        note=note,
        # Interference from other processes only ever adds time: the ratio of the minima is
        # the least disturbed view (kept for analysis; goals use the median ratio).
        extra={
            "ratio_of_medians": ours.median / theirs.median,
            "ratio_of_mins": ours.min / theirs.min,
        },
    )


@dataclass(frozen=True)
class Settings:
    """How hard to measure; ``--quick`` shrinks everything. ``deadline`` (``time.monotonic``)
    is when the whole run should be over; open-ended sections size their timeouts by it."""

    quick: bool
    out_dir: Path
    deadline: float = float("inf")
    # CleanRL's ppo.py and the Python to run it with (rl_throughput's reference, optional).
    cleanrl: Path | None = None
    cleanrl_python: str | None = None

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def reps(self, full: int, quick: int) -> int:
        return quick if self.quick else full


def interleave(
    methods: Mapping[str, Callable[[], float]], reps: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Call every method once per repetition, alternating the order (ABC, CBA, ...) so that
    drift and ordering effects hit every method alike; warm-up rounds are discarded.

    Each method returns one sample (usually seconds). The order depends only on the repetition
    index, so every rank of a collective benchmark calls the methods in the same order.
    """
    names = list(methods)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(warmup + reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            value = methods[name]()
            if rep >= warmup:
                samples[name].append(value)
    return samples


def timed(
    step: Callable[[], object], inner: int, sync: Callable[[], object], trailing_sync: bool = True
) -> float:
    """Seconds per call of ``step`` over ``inner`` back-to-back calls after a sync.

    With ``trailing_sync`` the clock stops after a second sync (every rank is done; the sync's
    cost is spread over ``inner`` calls). Without it the clock stops when this rank's last call
    returns: on a receiving rank that is when the data has arrived, with no sync in the time.
    """
    sync()
    start = time.perf_counter()
    for _ in range(inner):
        step()
    if trailing_sync:
        sync()
    return (time.perf_counter() - start) / inner
