"""The policy alone, from any checkpoint, on one process (evaluation and export)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from app.runtime.checkpoints.checkpoint import newest_valid_checkpoint
from app.runtime.checkpoints.shards import read_sharded_policy

log = logging.getLogger(__name__)


def load_policy_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The whole policy's state dict from a checkpoint (a ``.pt`` file, a sharded folder, a run
    dir or its checkpoints/ dir: its newest valid one). Checksums are verified; a sharded
    checkpoint's optimizer is not read."""
    picked = newest_valid_checkpoint(path)
    for note in picked.notes():
        log.warning("%s", note)
    if not picked.sharded:
        return dict(picked.state["policy"])
    return read_sharded_policy(picked.path)
