"""The history files: metrics.csv keeps each column's type (counts as integers, measurements as
floats, and every reader of the file, float() on each cell, reads both); a file goes on from a
checkpoint's offset, cut back to it, so no row is written twice; episodes.csv numbers every
episode of the run."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from app.runtime.records import COUNT_COLUMNS, HistoryFile, Offset, UpdateRecord
from app.runtime.records.history import offset_after_update
from app.runtime.records.recorder import episode_rows
from app.runtime.records.rows import update_row

pytestmark = pytest.mark.unit


def record(update: int, episodes_done: int = 0) -> UpdateRecord:
    return UpdateRecord(update=update, env_steps=2048 * update, attempt_steps=2048 * update,
                        elapsed=1.5, version=update, new=[(20.0, 20), (31.0, 31)], recent=25.5,
                        transfer_s=0.0, shared={}, losses={}, episodes_done=episodes_done)


def row(update: int, **more: float) -> dict[str, float]:
    # A rollout rank's row, as the Recorder makes it there: losses NaN.
    return {**update_row(record(update), {"pg_loss": math.nan}, 0.0, 0.0), **more}


def read(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_counts_are_written_as_integers_and_measurements_as_floats(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    metrics = HistoryFile(path, COUNT_COLUMNS)
    metrics.append([row(1, segments=2.0, replay_size=1.5)])
    metrics.append([row(2, segments=2.0, replay_size=3.0)])
    metrics.close()
    first, second = read(path)
    assert (first["update"], first["env_steps"], first["episodes"], first["weights_version"],
            first["segments"]) == ("1", "2048", "2", "1", "2")
    assert second["env_steps"] == "4096" and second["replay_size"] == "3"
    assert first["replay_size"] == "1.5"  # a count averaged over trainers, not whole: as it is
    assert (first["wall_s"], first["mean_return"], first["return_window"]) == ("1.5", "25.5",
                                                                               "25.5")
    assert first["pg_loss"] == "nan"  # no loss on this rank


def test_a_file_goes_on_from_an_offset_cut_back_to_it(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    metrics = HistoryFile(path, COUNT_COLUMNS)
    for update in (1, 2):
        metrics.append([row(update)])
    kept = metrics.offset
    for update in (3, 4):  # after the checkpoint: the resumed run makes these again
        metrics.append([row(update)])
    metrics.close()
    assert kept.rows == 2 and 0 < kept.size < path.stat().st_size
    again = HistoryFile(path, COUNT_COLUMNS, at=kept)
    assert again.offset == kept
    again.append([row(3)])
    again.close()
    assert [r["update"] for r in read(path)] == ["1", "2", "3"]


def test_a_file_shorter_than_its_offset_keeps_its_whole_rows(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    metrics = HistoryFile(path, COUNT_COLUMNS)
    metrics.append([row(1), row(2)])
    metrics.close()
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # the last row cut by a lost write
    again = HistoryFile(path, COUNT_COLUMNS, at=Offset(2, len(whole)))
    assert again.offset.rows == 1
    again.append([row(2)])
    again.close()
    assert [r["update"] for r in read(path)] == ["1", "2"]


def test_a_new_file_replaces_what_an_earlier_attempt_left(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("update,env_steps\n1,2048\n")  # an attempt that failed before a checkpoint
    metrics = HistoryFile(path, COUNT_COLUMNS)
    metrics.append([row(1)])
    metrics.close()
    assert [r["update"] for r in read(path)] == ["1"] and "wall_s" in read(path)[0]


def test_the_offset_after_an_update_of_a_file_a_checkpoint_recorded_none_for(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.csv"
    metrics = HistoryFile(path, COUNT_COLUMNS)
    metrics.append([row(1), row(2)])
    after_two = metrics.offset
    metrics.append([row(3)])
    metrics.close()
    assert offset_after_update(path, 2) == after_two
    assert offset_after_update(path, 0).rows == 0
    assert offset_after_update(tmp_path / "missing.csv", 2) == Offset()


def test_episodes_are_numbered_over_the_run(tmp_path: Path) -> None:
    rows = episode_rows(record(3, episodes_done=7))
    assert [(r["episode"], r["update"], r["return"], r["length"]) for r in rows] == [
        (6, 3, 20.0, 20), (7, 3, 31.0, 31)]
