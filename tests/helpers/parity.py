"""Loss parity between training grids (tests/integration/test_sharding.py,
test_sequence_parallel.py): per-update losses averaged over the trainers, and their gap."""

from __future__ import annotations

from typing import Any

# Float reassociation (reduce-scatter against all-reduce, split or chunked matmuls) moves the
# losses by about 1e-6 relative; a real change of the update (a quarter of one gradient
# dropped) by about 1e-2.
TOLERANCE = 1e-4


def mean_losses(results: dict[int, Any]) -> list[dict[str, float]]:
    """Per update, each figure averaged over the trainers (as metrics.csv reports it); each
    rank's result holds ``losses``, one dict per update."""
    ranks = sorted(results)
    updates = len(results[ranks[0]]["losses"])
    return [{name: sum(results[r]["losses"][u][name] for r in ranks) / len(ranks)
             for name in results[ranks[0]]["losses"][u]} for u in range(updates)]


def largest_gap(a: list[dict[str, float]], b: list[dict[str, float]]) -> tuple[float, str]:
    """The largest relative gap of the PPO losses, and where it is."""
    assert len(a) == len(b), (len(a), len(b))
    # Relative, against at least 0.01: the policy loss crosses zero.
    gaps = [(abs(x[k] - y[k]) / max(abs(x[k]), 1e-2), f"update {u} {k}")
            for u, (x, y) in enumerate(zip(a, b)) for k in ("pg_loss", "v_loss", "entropy")]
    return max(gaps)
