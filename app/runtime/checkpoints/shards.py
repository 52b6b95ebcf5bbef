"""A sharded checkpoint, written and read with ``torch.distributed.checkpoint`` (DCP); the
one-file form and what both share (the format, checksums, picking) are
app/runtime/checkpoints/checkpoint.py's.

Written: every trainer writes its own shards into ``ckpt_<update>.tmp/``, the trainers hash the
files in turn, and the first one writes ``state.pt`` and renames the folder into place. Read:
each trainer reads its own part of each tensor for its grid, whatever grid wrote it."""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from app.runtime.checkpoints.agreement import policy_shapes
from app.runtime.checkpoints.checkpoint import (
    CHECKPOINT_DIR,
    SHARDED_FORMAT,
    STATE_FILE,
    TrainingState,
    content_checksum,
    file_digest,
    named_write_error,
)
from app.runtime.checkpoints.durable import remove_stale, sync_folder, write_synced

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from app.runtime.trainer.trained import TrainedModule

log = logging.getLogger(__name__)


@dataclass
class StagedShards:
    """A sharded checkpoint under way on one trainer of its ``group``: its folder's final and
    partial names, DCP's upload of this trainer's shards (``torch.distributed.checkpoint``'s
    ``async_save``: staged, copied, at once, then written in DCP's thread), and on the group's
    first rank what its ``state.pt`` holds besides the manifest (``head``)."""

    final: Path
    partial: Path
    group: ProcessGroup
    upload: Future[Any]
    head: dict[str, Any] | None


def save_sharded_checkpoint(run_dir: Path, trained: TrainedModule, optimizer: torch.optim.Optimizer,
                            group: ProcessGroup, state: TrainingState) -> Path | None:
    """Writes the folder ``ckpt_<update>/``, now: :func:`stage_sharded_checkpoint`, then
    :func:`finish_sharded_checkpoint`; every trainer of ``group`` calls it."""
    staged = stage_sharded_checkpoint(run_dir, trained, optimizer, group, state)
    return finish_sharded_checkpoint(staged) if staged is not None else None


def stage_sharded_checkpoint(run_dir: Path, trained: TrainedModule,
                             optimizer: torch.optim.Optimizer, group: ProcessGroup,
                             state: TrainingState, clear_stale: bool = True) -> StagedShards | None:
    """Starts the folder ``ckpt_<update>/``; every trainer of ``group`` (the trainers, no
    rollout rank) calls it, between two updates. Each stages its own shards of the policy and
    the optimizer (a copy) and DCP writes them in the background; :func:`finish_sharded_checkpoint`
    completes the folder. ``group`` carries the checkpoint's collectives only (a group of its
    own when they run beside training). ``clear_stale``: the first rank first removes the
    stale ``.tmp`` files a killed rank left (a barrier after it). None on a trainer that
    returns without raising after a failed cleanup."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    folder = run_dir / CHECKPOINT_DIR
    final = folder / f"ckpt_{state.update:06d}"
    partial = folder / f"{final.name}.tmp"
    me = dist.get_rank(group)
    if clear_stale and not _cleared(folder, final, partial, group, lead=me == 0):
        return None
    head = _state_head(trained, state) if me == 0 else None
    upload = dcp.async_save(trained.sharded_state(optimizer),
                            storage_writer=dcp.FileSystemWriter(partial, sync_files=True),
                            process_group=group)
    if not isinstance(upload, Future):  # an AsyncSaveResponse (a stager of our own): none here
        raise TypeError(f"torch.distributed.checkpoint.async_save returned {type(upload)}")
    return StagedShards(final, partial, group, upload, head)


def finish_sharded_checkpoint(staged: StagedShards) -> Path | None:
    """Completes a staged folder (off the training thread, on its group): once every trainer's
    shards are written, the trainers hash the files in turn, and the group's first rank writes
    ``state.pt`` (the counters, last episodes, history offsets, normalisers, RNG, settings, the
    whole policy's shapes, and the manifest: every other file's SHA-256 and size) and renames
    the folder from ``ckpt_<update>.tmp/``. Never half-written: a failure removes the ``.tmp``
    folder; the first trainer whose own write failed raises it (an OSError naming the
    checkpoint, or its file when the error names one, and noting the last complete
    checkpoint), the others return None (the failed rank ends the run). Returns the folder on
    the first rank."""
    import torch.distributed as dist

    group, final, partial = staged.group, staged.final, staged.partial
    me, size = dist.get_rank(group), dist.get_world_size(group)
    if not _uploaded(staged, me):
        return None
    files = _hash_in_turn(partial, group, me, size)
    if staged.head is None:
        return None
    written = {**staged.head, "files": files}
    written["checksum"] = content_checksum(written)
    folder = final.parent
    _write_state_and_rename(written, folder, final, partial)
    log.info("checkpoint %s (update %d, %d env steps, %d trainers' shards)", final.name,
             written["update"], written["env_steps"], size)
    return final


def _state_head(trained: TrainedModule, state: TrainingState) -> dict[str, Any]:
    """What the first rank's ``state.pt`` holds besides its manifest, as of now."""
    return {
        "policy_shapes": policy_shapes(trained.net),
        "normalizers": {k: v.clone() for k, v in state.normalizers.items()},
        "update": state.update,
        "env_steps": state.env_steps,
        "epoch": state.epoch,
        "episodes": list(state.episodes),
        "episodes_done": state.episodes_done,
        "history": dict(state.history),
        "train_s": state.train_s,
        "reached_at": state.reached_at,
        "torch_rng": torch.get_rng_state(),
        "format": SHARDED_FORMAT,
        "settings": dict(state.settings),
    }


def _cleared(folder: Path, final: Path, partial: Path, group: ProcessGroup, lead: bool) -> bool:
    """The first rank removes stale ``.tmp`` files and folders before anyone writes (one may
    have this very name); the all-reduce doubles as the barrier after it, and a failed cleanup
    stops every trainer there (raised on the first rank, False on the others)."""
    import torch.distributed as dist

    problem: OSError | None = None
    if lead:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            remove_stale(folder)
        except OSError as err:
            problem = named_write_error(err, final, partial, folder)
    failed = torch.tensor([problem is not None], dtype=torch.int64)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if problem is not None:
        raise problem
    return not int(failed)


def _uploaded(staged: StagedShards, me: int) -> bool:
    """Waits for this trainer's shards; False on the trainers that return without raising
    after a failed write."""
    import torch.distributed.checkpoint as dcp

    try:
        staged.upload.result()
    except dcp.CheckpointException as err:  # raised on every trainer, naming each one that failed
        if me == 0:
            shutil.rmtree(staged.partial, ignore_errors=True)
        # One trainer raises, the first that failed (on a full disk every one may have): the
        # run ends with one line. The others return unlogged: on a full disk their logs would
        # fail too, and name a log file instead of the checkpoint.
        if me != min(err.failures, default=0):
            return False
        cause = err.failures[me][0] if me in err.failures else err
        final = staged.final
        if isinstance(cause, OSError):  # a write through a handle names no file: the folder
            raise named_write_error(cause, final, staged.partial, final.parent) from None
        raise RuntimeError(f"writing {final}: {type(cause).__name__}: {cause}") from cause
    return True


def _hash_in_turn(partial: Path, group: ProcessGroup, me: int, size: int) -> dict[str, Any]:
    """Every file's SHA-256 and size, each trainer hashing its share, not one rank all. Every
    file is complete and synced once ``dcp.save`` returns (its last step, after every write, is
    the first rank's ``.metadata``)."""
    import torch.distributed as dist

    files = sorted(p.name for p in partial.iterdir())
    mine = {name: [file_digest(partial / name), (partial / name).stat().st_size]
            for name in files[me::size]}
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    return {name: entry for part in gathered for name, entry in sorted(part.items())}


def _write_state_and_rename(state: dict[str, Any], folder: Path, final: Path,
                            partial: Path) -> None:
    """``state.pt`` last, then the folder renamed into place; a failure removes ``partial``."""
    replaced = folder / f"{final.name}.replaced.tmp"
    try:
        write_synced(partial / STATE_FILE, state)
        sync_folder(partial)
        if final.is_dir() and not final.is_symlink():
            # A run restarted from an older checkpoint writes this update again: the old folder
            # is set aside first (a folder cannot be renamed over a full one).
            os.replace(final, replaced)
        os.replace(partial, final)
    except BaseException as err:  # an interrupt too: no partial folder survives
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, OSError):
            named_write_error(err, final, partial, folder)
        raise
    shutil.rmtree(replaced, ignore_errors=True)
    sync_folder(folder)


def load_sharded_checkpoint(path: Path, trained: TrainedModule, optimizer: torch.optim.Optimizer,
                            group: ProcessGroup | None) -> None:
    """A sharded checkpoint's policy and optimizer into this trainer, whatever grid wrote it:
    DCP reads each trainer's own part of each tensor for this grid's shards (or whole tensors
    under DDP). Every trainer of ``group`` calls it; None: an unsharded trainer, which reads
    its whole tensors on its own. ``path`` was verified when picked."""
    import torch.distributed.checkpoint as dcp

    state = trained.sharded_state(optimizer)  # this grid's own tensors, filled in place
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=group,
                     no_dist=group is None)
    except dcp.CheckpointException as err:  # a BaseException: as an error of this rank instead
        raise RuntimeError(f"loop.resume: reading {path}: {_first_failure(err)}") from None
    trained.load_sharded_state(state, optimizer)


def read_sharded_policy(path: Path) -> dict[str, torch.Tensor]:
    """The whole policy of the sharded checkpoint at ``path`` (verified when picked), on one
    process without a process group; its optimizer is not read."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(path)
    prefix = "policy."  # DCP flattens {"policy": {name: tensor}} to "policy.<name>"
    policy = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
              for key, meta in reader.read_metadata().state_dict_metadata.items()
              if key.startswith(prefix) and isinstance(meta, dcp.TensorStorageMetadata)}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load({"policy": policy}, storage_reader=reader, no_dist=True)
    except dcp.CheckpointException as err:
        raise RuntimeError(f"reading {path}: {_first_failure(err)}") from None
    return policy


def _first_failure(err: BaseException) -> str:
    failures = getattr(err, "failures", {})
    for rank in sorted(failures):
        cause = failures[rank][0]
        return f"{type(cause).__name__}: {cause}"
    return str(err)
