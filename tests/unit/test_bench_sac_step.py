"""``python -m benchmarks.sac_step``: one SAC learner step's operations counted, and its time
and this machine's matrix-product rate printed for 1 and 2 threads (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import sac_step

pytestmark = pytest.mark.unit


def test_the_learner_step_is_counted_and_timed_on_one_and_two_threads(
        capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert sac_step.main(["--steps", "3"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["1", "2"], rows
    gflop = {float(r.split("|")[2]) for r in rows[1:]}
    # The same step on either thread count. By hand: the twin Q step's three passes over both
    # networks (~0.21 GFLOP), the targets' forward (~0.11) and one actor step on average
    # (~0.29, the Q-networks' weight gradients left out): about 0.6 GFLOP at batch 256.
    assert len(gflop) == 1 and 0.45 < gflop.pop() < 0.75, rows
    for row in rows[1:]:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert float(cells[2].removesuffix(" ms")) > 0 and float(cells[3]) > 0, row
