"""What an offline W&B run wrote, read back: its ``run-<id>.wandb`` file is W&B's transaction log
(``wandb sync`` uploads it), a LevelDB-style log of W&B's own protobuf ``Record`` messages
(``wandb.proto.wandb_internal_pb2``): history rows, config and summary updates, artifacts."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024  # LevelDB log blocks; a record's header never straddles two
HEADER = 7  # checksum (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
MAGIC = b":W&B"


def records(path: Path) -> Iterator[Any]:
    """Every ``Record`` of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == MAGIC, data[:8]
    pos, parts = 7, b""  # after the file's header: magic, version (2), 0
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts + chunk)
            parts = b""
            yield record
        else:
            parts = chunk if kind == FIRST else parts + chunk


@dataclass
class OfflineRun:
    """One offline W&B run as its file holds it: ``history`` (step -> values), ``config``,
    ``summary`` and the files of its artifacts."""

    run_id: str
    resumable: bool
    project: str = ""
    entity: str = ""
    history: dict[int, dict[str, Any]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, list[str]] = field(default_factory=dict)  # name -> file paths
    exit_code: int | None = None


def read_offline_run(folder: Path) -> OfflineRun:
    """``<run dir>/wandb/offline-run-<time>-<id>/``, read back."""
    (path,) = folder.glob("run-*.wandb")
    run: OfflineRun | None = None
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = OfflineRun(record.run.run_id, record.run.resume, record.run.project,
                             record.run.entity)
            run.config.update(_items(record.run.config.update))
        if run is None:  # the file's header, written before the run's record
            continue
        if kind == "history":
            values = _items(record.history.item)
            run.history[int(record.history.step.num)] = values
        elif kind == "config":
            run.config.update(_items(record.config.update))
        elif kind == "summary":
            run.summary.update(_items(record.summary.update))
        elif kind == "artifact":
            run.artifacts[record.artifact.name] = [c.path for c in
                                                   record.artifact.manifest.contents]
        elif kind == "exit":
            run.exit_code = int(record.exit.exit_code)
    assert run is not None, f"{path} holds no run"
    return run


def _items(items: Any) -> dict[str, Any]:
    return {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}
