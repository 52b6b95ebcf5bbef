"""metrics.csv keeps each column's type: counts are written as integers, measurements as
floats, and every reader of the file (float() on each cell) reads both."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from app.runtime.records import MetricsFile, UpdateRecord
from app.runtime.records.rows import update_row

pytestmark = pytest.mark.unit


def row(update: int, **more: float) -> dict[str, float]:
    # A rollout rank's row, as the Recorder makes it there: losses NaN.
    record = UpdateRecord(update=update, env_steps=2048 * update, attempt_steps=2048 * update,
                          elapsed=1.5, version=update, new=[(20.0, 20), (31.0, 31)], recent=25.5,
                          transfer_s=0.0, shared={}, losses={})
    return {**update_row(record, {"pg_loss": math.nan}, 0.0, 0.0), **more}


def test_counts_are_written_as_integers_and_measurements_as_floats(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    metrics = MetricsFile(path, [row(1, segments=2.0, replay_size=1.5)])
    metrics.append(row(2, segments=2.0, replay_size=3.0))
    metrics.close()
    with path.open() as handle:
        first, second = csv.DictReader(handle)
    assert (first["update"], first["env_steps"], first["episodes"], first["weights_version"],
            first["segments"]) == ("1", "2048", "2", "1", "2")
    assert second["env_steps"] == "4096" and second["replay_size"] == "3"
    assert first["replay_size"] == "1.5"  # a count averaged over trainers, not whole: as it is
    assert (first["wall_s"], first["mean_return"], first["return_window"]) == ("1.5", "25.5",
                                                                               "25.5")
    assert first["pg_loss"] == "nan"  # no loss on this rank


def test_rows_of_an_earlier_attempt_are_rewritten_with_their_counts_as_integers(
    tmp_path: Path,
) -> None:
    earlier = {name: float(value) for name, value in row(1).items()}  # rows kept as floats
    path = tmp_path / "metrics.csv"
    MetricsFile(path, [earlier]).close()
    with path.open() as handle:
        (written,) = csv.DictReader(handle)
    assert written["update"] == "1" and written["env_steps"] == "2048"
    assert math.isnan(float(written["pg_loss"])) and float(written["update"]) == 1.0
