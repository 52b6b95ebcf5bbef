"""Files a crash cannot leave half-written: written aside, synced, then renamed by the caller
(the checkpoints: app/runtime/checkpoints/checkpoint.py, app/runtime/checkpoints/shards.py)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


def remove_stale(folder: Path) -> None:
    """Removes the ``*.tmp`` files and folders a rank killed inside a write left."""
    for stale in folder.glob("*.tmp"):
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        else:
            stale.unlink(missing_ok=True)


def write_synced(path: Path, state: Mapping[str, Any]) -> None:
    """``state`` saved to ``path`` and synced, through Python's file calls: a full disk is an
    OSError naming the file (ENOSPC), not torch's zip writer's error."""
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    with path.open("wb") as handle:
        handle.write(buffer.getbuffer())
        handle.flush()
        os.fsync(handle.fileno())


def sync_folder(folder: Path) -> None:
    """Makes the rename durable; best effort (not every filesystem syncs a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
