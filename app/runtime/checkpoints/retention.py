"""Which checkpoints a run keeps: the newest ``loop.checkpoint_keep``, ``checkpoints/best``, and
milestones (``loop.milestone_every``, ``loop.milestone_every_s``) in ``checkpoints/milestones/``.

Older checkpoints are removed only once a newer one is durable (written, synced and renamed:
app/runtime/checkpoints/checkpoint.py), so a crash at any point leaves at least the newest
complete checkpoint; a resume picks the newest that verifies among those kept, as before. A
milestone is the first checkpoint written at or past each multiple of the milestone cadence,
hard-linked into ``milestones/`` (copied where the file system has no hard links): it costs no
space while it is also among the newest, and retention never touches that folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

from app.runtime.checkpoints.checkpoint import is_checkpoint, update_of

log = logging.getLogger(__name__)
MILESTONES = "milestones"
REPLAY = "replay"  # loop.replay.checkpoint's shards: replay/ckpt_<update>.<holder>.pt


def kept_checkpoints(folder: Path) -> list[Path]:
    """The checkpoints in ``folder`` (files and sharded folders, never ``*.tmp``), newest
    first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if is_checkpoint(p)]
    return sorted(found, key=lambda p: (update_of(p), p.name), reverse=True)


def retire(folder: Path, keep: int) -> list[Path]:
    """Removes every checkpoint in ``folder`` but the newest ``keep``, and the replay shards of
    updates no longer kept; returns what it removed. ``best`` and ``milestones/`` stay."""
    found = kept_checkpoints(folder)
    removed = found[keep:]
    for old in removed:
        _remove(old)
    kept = {update_of(p) for p in found[:keep]}
    shards = folder / REPLAY
    if shards.is_dir():
        for shard in shards.iterdir():
            update = _shard_update(shard)
            if update is not None and update not in kept:
                _remove(shard)
    if removed:
        log.debug("removed checkpoints %s", ", ".join(p.name for p in removed))
    return removed


def keep_as_milestone(checkpoint: Path) -> Path:
    """``checkpoint`` (a file or a sharded folder) also in ``milestones/`` beside it."""
    target = checkpoint.parent / MILESTONES / checkpoint.name
    target.parent.mkdir(exist_ok=True)
    partial = target.with_name(f"{target.name}.tmp")
    _remove(partial)
    if checkpoint.is_dir():
        shutil.copytree(checkpoint, partial, copy_function=_link_or_copy)
    else:
        _link_or_copy(str(checkpoint), str(partial))
    if target.is_dir():
        shutil.rmtree(target)
    os.replace(partial, target)
    return target


def is_milestone(before: tuple[int, float] | None, now: tuple[int, float],
                 every: int, every_s: float) -> bool:
    """Whether a checkpoint at ``now`` (update, seconds trained) is the first at or past a
    multiple of ``every`` updates or ``every_s`` seconds since the checkpoint ``before`` (None:
    the run's first)."""
    last_update, last_s = before if before is not None else (0, 0.0)
    by_updates = every > 0 and now[0] // every > last_update // every
    by_time = every_s > 0 and now[1] // every_s > last_s // every_s
    return by_updates or by_time


def _shard_update(path: Path) -> int | None:
    head = path.name.split(".", 1)[0]
    return update_of(Path(head)) if head.startswith("ckpt_") else None


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
