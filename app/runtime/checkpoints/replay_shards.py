"""Replay shards saved beside a checkpoint (``loop.replay.checkpoint``): each trainer that holds
a replay shard writes it as ``checkpoints/replay/ckpt_<update>.shard<i>.pt`` (``i``: its place
among the ``holders``), with a checksum, written aside, synced and renamed, in the same
background write as the checkpoint. They belong to the checkpoint of that update: retention
removes them with it (app/runtime/checkpoints/retention.py).

On resume, the shards of the picked checkpoint are dealt to this run's holders: holder ``i`` of
``H`` takes shard ``j`` for every ``j`` with ``j mod H == i`` (the same layout: its own shard),
and a shard that is missing or does not verify is named in a warning and left out: that holder
refills, as a run without replay checkpoints does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from app.runtime.checkpoints.checkpoint import CheckpointProblem, content_checksum
from app.runtime.checkpoints.durable import sync_folder, write_synced
from app.runtime.checkpoints.retention import REPLAY

log = logging.getLogger(__name__)
_NAME = re.compile(r"ckpt_(\d+)\.shard(\d+)\.pt")


class ReplayShard(Protocol):
    """What a trainer's replay shard gives and takes (app/runtime/replay/client.py's
    ``LocalReplay``)."""

    def contents(self) -> dict[str, Any]: ...

    def restore(self, held: Sequence[Mapping[str, Any]]) -> None: ...


def shard_path(folder: Path, update: int, holder: int) -> Path:
    """Where holder ``holder``'s shard of the checkpoint of ``update`` is written
    (``folder``: the run's checkpoints/)."""
    return folder / REPLAY / f"ckpt_{update:06d}.shard{holder}.pt"


def write_shard(path: Path, contents: Mapping[str, Any], holders: int) -> None:
    """One holder's shard (a snapshot: :meth:`ReplayShard.contents`), durable."""
    written = {**contents, "holders": holders}
    written["checksum"] = content_checksum(written)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    try:
        write_synced(partial, written)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def dealt_shards(checkpoint: Path, update: int, holder: int,
                 holders: int) -> list[dict[str, Any]]:
    """The shards of the checkpoint of ``update`` (``checkpoint``: its file or folder) that
    holder ``holder`` of ``holders`` takes, read and verified; missing or broken ones are named
    in a warning and left out."""
    folder = checkpoint.parent / REPLAY
    found = sorted(
        (int(m.group(2)), p) for p in (folder.iterdir() if folder.is_dir() else [])
        if (m := _NAME.fullmatch(p.name)) and int(m.group(1)) == update)
    taken: list[dict[str, Any]] = []
    expected: int | None = None
    for index, path in found:
        try:
            shard = _read(path)
        except CheckpointProblem as problem:
            log.warning("loop.replay.checkpoint: %s is %s; its transitions are not restored",
                        path, problem)
            continue
        expected = int(shard["holders"])
        if index % holders == holder:
            taken.append(shard)
    present = {index for index, _ in found}
    for index in range(expected or 0):
        if index not in present and index % holders == holder:
            log.warning("loop.replay.checkpoint: %s is missing; its transitions are not "
                        "restored", shard_path(checkpoint.parent, update, index))
    return taken


def _read(path: Path) -> dict[str, Any]:
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointProblem(f"not readable ({type(err).__name__})") from None
    if not isinstance(shard, dict) or shard.get("checksum") != content_checksum(shard):
        raise CheckpointProblem("corrupt (its content does not match its checksum)")
    return shard
