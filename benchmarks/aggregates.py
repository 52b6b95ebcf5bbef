"""Aggregates over independent runs (seeds), as "Deep RL at the Edge of the Statistical
Precipice" (Agarwal et al., NeurIPS 2021) and its library ``rliable`` compute them: the
interquartile mean, the median, and percentile confidence intervals from a stratified bootstrap
over the runs. Written plainly in numpy (``rliable`` brings ``arch``, ``seaborn`` and more for
these few lines).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# rliable's aggregate_iqm: scipy.stats.trim_mean(scores, proportiontocut=0.25).
IQM_CUT = 0.25
BOOTSTRAP_REPS = 10_000
CONFIDENCE = 0.95

# A statistic of runs, applied to many samples at once: [samples, runs] -> [samples].
Statistic = Callable[[np.ndarray], np.ndarray]


def iqm_rows(samples: np.ndarray) -> np.ndarray:
    """The interquartile mean of each row: the mean of its middle 50%, after cutting
    ``floor(0.25 n)`` values from each end (scipy's ``trim_mean(row, 0.25)``, rliable's
    ``aggregate_iqm``)."""
    ordered = np.sort(samples, axis=1)
    cut = int(IQM_CUT * ordered.shape[1])
    return ordered[:, cut:ordered.shape[1] - cut].mean(axis=1)


def median_rows(samples: np.ndarray) -> np.ndarray:
    """The median of each row."""
    return np.median(samples, axis=1)


def mean_rows(samples: np.ndarray) -> np.ndarray:
    """The mean of each row (of 0/1 outcomes: the fraction of successes)."""
    return samples.mean(axis=1)


def _runs(values: Sequence[float] | np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=float).ravel()
    if array.size == 0:
        raise ValueError("a statistic of no values")
    return array


def iqm(values: Sequence[float] | np.ndarray) -> float:
    """The interquartile mean of ``values`` (:func:`iqm_rows`)."""
    return float(iqm_rows(_runs(values)[None])[0])


def median(values: Sequence[float] | np.ndarray) -> float:
    """The median of ``values``."""
    return float(np.median(_runs(values)))


@dataclass(frozen=True)
class Interval:
    """A point estimate and its percentile bootstrap confidence interval."""

    value: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}


def stratified_bootstrap(
    runs: Mapping[str, Sequence[float]],
    statistic: Statistic,
    reps: int = BOOTSTRAP_REPS,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Interval:
    """``statistic`` of every run pooled, with its percentile confidence interval from a
    stratified bootstrap: each replicate draws, within each task (a key of ``runs``), as many
    runs as the task has, with replacement, and applies ``statistic`` to the pooled draw
    (rliable's ``StratifiedBootstrap``; with one task, the plain bootstrap over its runs)."""
    strata = [np.asarray(v, dtype=float).ravel() for v in runs.values()]
    if not strata or any(s.size == 0 for s in strata):
        raise ValueError("every task needs at least one run")
    rng = np.random.default_rng(seed)
    draws = np.concatenate([s[rng.integers(0, s.size, (reps, s.size))] for s in strata], axis=1)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(statistic(draws), [tail, 100 - tail])
    return Interval(float(statistic(np.concatenate(strata)[None])[0]), float(low), float(high))


def bootstrap(values: Sequence[float], statistic: Statistic, reps: int = BOOTSTRAP_REPS,
              confidence: float = CONFIDENCE, seed: int = 0) -> Interval:
    """:func:`stratified_bootstrap` of one task's runs."""
    return stratified_bootstrap({"runs": values}, statistic, reps, confidence, seed)
