"""Checkpoints, read by every rank on resume (``loop.resume``, or the agent restarting a failed
run). A checkpoint holds everything the runtime owns: the policy, the normalisers' statistics, the
optimizer, the counters, the last episodes and how far into the run's history files
(``metrics.csv``, ``episodes.csv``) the run was; its size does not grow with the run. It takes
one of two forms:

- ``<run dir>/checkpoints/ckpt_<update>.pt``, one file by rank 0, when the trainers use DDP;
- ``<run dir>/checkpoints/ckpt_<update>/``, a folder, when the trainers shard it: each
  trainer's DCP shards and rank 0's ``state.pt`` with the rest and every file's SHA-256
  (written and read by app/runtime/checkpoints/shards.py: a resume reshards into whatever grid
  it runs on, DDP too); app/runtime/checkpoints/policy.py reads the policy on one process.

A checkpoint proves itself: it carries a SHA-256 of its content (every tensor's bytes and every
value, walked in a fixed order, so the digest does not depend on torch's file format) and the
settings it was written with (app/runtime/checkpoints/agreement.py). The launcher compares those
settings with the run's before any rank starts; a resume from a folder takes its
newest checkpoint that reads back and verifies, skipping (and naming) any that does not. One
written before checksums is accepted with a note: only its tensor shapes can be compared.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.api import ConfigError, JobInfo
from app.output.logs import FILE_ONLY
from app.runtime.checkpoints.durable import remove_stale, sync_folder, write_synced
from rlcomm import CommContext, ParallelMode, collectives

log = logging.getLogger(__name__)
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_KEYS = ("policy", "optimizer", "update", "env_steps", "episodes", "torch_rng")
# 4: the last episodes and the history files' offsets instead of every episode and metrics row;
# 2: a checksum and the writing run's settings (format 1, no "format" key: neither).
FORMAT = 4
# A sharded checkpoint's rank-0 STATE_FILE: "files", the manifest of DCP's files, and
# "policy_shapes", for the check before launch, which reads no shard.
SHARDED_FORMAT = 4
STATE_FILE = "state.pt"
SHARDED_KEYS = ("update", "env_steps", "episodes", "torch_rng", "files", "checksum",
                "policy_shapes")
_NAME = re.compile(r"ckpt_(\d+)(\.pt)?")
_HASH_CHUNK = 1 << 20


class NoCheckpointError(ConfigError):
    """A resume path that holds no checkpoint file at all (a fresh run dir, or only ``*.tmp``)."""


class CheckpointProblem(Exception):
    """Why one checkpoint file cannot be resumed from; ``str()`` completes ``'<path>' is ...``."""


@dataclass
class Resumable:
    """The checkpoint a resume starts from, its state, and the newer files it passed over."""

    path: Path
    state: dict[str, Any]
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def sharded(self) -> bool:
        """A folder written by sharded trainers: ``state`` holds no policy or optimizer, which
        :func:`load_sharded_checkpoint` (trainers) or :func:`load_policy_state` read."""
        return self.path.is_dir()

    @property
    def verified(self) -> bool:
        """False for a checkpoint written before checkpoints carried a checksum."""
        return "checksum" in self.state

    def notes(self) -> list[str]:
        """One warning line per skipped file, and one for an unverifiable old checkpoint."""
        lines = [f"loop.resume: skipped {path}: {reason}; resuming from {self.path.name}"
                 for path, reason in self.skipped]
        if not self.verified:
            lines.append(
                f"loop.resume: {self.path} has no checksum (written before checkpoints carried "
                "one): resuming from it unverified, comparing only its tensor shapes"
            )
        return lines


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint holds besides the policy and the optimizer: the counters, the last
    finished episodes (what the stop rule reads) and how many there were, where the run's
    history files stood (``history``: app/runtime/records/recorder.py's ``RecordsMark``, as
    plain values), the run's settings (agreement.run_settings), the normalisers' statistics, an
    elastic run's membership epoch, an off-policy algorithm's own state
    (``Algorithm.state_dict``; sharded trainers keep none), the seconds trained so far over
    every attempt (``train_s``) and when and at how many env steps the target was first reached
    (``reached_at``), so that a restart keeps the run's history."""

    update: int
    env_steps: int
    episodes: list[tuple[float, int]] = field(default_factory=list)
    episodes_done: int = 0
    history: Mapping[str, Any] = field(default_factory=dict)
    settings: Mapping[str, Any] = field(default_factory=dict)
    normalizers: Mapping[str, torch.Tensor] = field(default_factory=dict)
    epoch: int | None = None
    algorithm: Mapping[str, Any] = field(default_factory=dict)
    train_s: float = 0.0
    reached_at: tuple[float, int] | None = None


@dataclass(frozen=True)
class WholeCheckpoint:
    """A flat trainer's checkpoint as of when it was taken (copies), to be written later:
    ``checkpoints/best``, once its evaluation has come back."""

    policy: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, Any]
    state: TrainingState


# ---- checksums ----------------------------------------------------------------------------


def content_checksum(state: Mapping[str, Any]) -> str:
    """SHA-256 of a checkpoint's content (every key but ``checksum``), in a canonical walk."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in state.items() if k != "checksum"})
    return digest.hexdigest()


def _feed(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{list(t.shape)}:".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, Mapping):
        digest.update(f"D{len(obj)}:".encode())
        for key, value in obj.items():
            _feed(digest, key)
            _feed(digest, value)
    elif isinstance(obj, (list, tuple)):
        digest.update(f"L{len(obj)}:".encode())
        for item in obj:
            _feed(digest, item)
    elif isinstance(obj, str):
        digest.update(f"S{len(obj)}:{obj}".encode())
    elif obj is None or isinstance(obj, bool):
        digest.update(f"B{obj};".encode())
    elif isinstance(obj, numbers.Integral):
        digest.update(f"I{int(obj)};".encode())
    elif isinstance(obj, numbers.Real):
        digest.update(f"F{float(obj).hex()};".encode())
    else:
        raise TypeError(f"a checkpoint holds no {type(obj).__name__}")


# ---- reading -------------------------------------------------------------------------------


def _read(path: Path, shards: bool = True) -> dict[str, Any]:
    """A checkpoint's state, verified; raises CheckpointProblem saying why it cannot be used.
    For a sharded checkpoint (a folder): rank 0's state, its manifest's files checked too
    (their SHA-256, or with ``shards=False`` only that they are there with their sizes)."""
    if path.is_dir():
        return _read_sharded(path, shards)
    return _read_file(path, CHECKPOINT_KEYS)


def _read_file(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:120]
        raise CheckpointProblem(
            f"not a readable checkpoint (truncated or corrupt: {type(err).__name__}: {first})"
        ) from None
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointProblem(f"not a checkpoint of this runtime (missing {missing})")
    if "checksum" in state and state["checksum"] != content_checksum(state):
        raise CheckpointProblem("corrupt (its content does not match its checksum)")
    return state


def _read_sharded(path: Path, shards: bool) -> dict[str, Any]:
    if not (path / STATE_FILE).is_file():
        raise CheckpointProblem(f"not a complete checkpoint (no {STATE_FILE}, its manifest)")
    state = _read_file(path / STATE_FILE, SHARDED_KEYS)
    for name, (digest, size) in state["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointProblem(f"incomplete (its {name} is missing)")
        if file.stat().st_size != size or (shards and file_digest(file) != digest):
            raise CheckpointProblem(f"corrupt ({name} does not match its checksum)")
    return state


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, read in chunks (a shard may be large)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's state, its checksum verified; tensors and plain containers only
    (``weights_only``: no code). A sharded checkpoint's is rank 0's part (no policy or
    optimizer; :func:`load_policy_state` reads the policy)."""
    try:
        return _read(path)
    except CheckpointProblem as problem:
        raise ConfigError(f"loop.resume: {str(path)!r} is {problem}") from None


def is_checkpoint(path: Path) -> bool:
    """A ``ckpt_<n>.pt`` file or a ``ckpt_<n>`` folder (never a ``*.tmp``)."""
    match = _NAME.fullmatch(path.name)
    return match is not None and (path.is_file() if match.group(2) else path.is_dir())


def update_of(path: Path) -> int:
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match else -1


def _candidates(path: str | Path) -> list[Path]:
    """The checkpoints at ``path``, newest first (``*.tmp`` never counts)."""
    target = Path(path)
    if target.is_file() or is_checkpoint(target):
        return [target]
    if not target.exists():
        raise ConfigError(f"loop.resume: {str(path)!r} does not exist")
    found = [p for folder in (target / CHECKPOINT_DIR, target) if folder.is_dir()
             for p in folder.iterdir() if is_checkpoint(p)]
    if not found:
        raise NoCheckpointError(
            f"loop.resume: {str(path)!r} holds no checkpoint (ckpt_*.pt or ckpt_*/)")
    return sorted(found, key=lambda p: (update_of(p), p.name), reverse=True)


def newest_valid_checkpoint(path: str | Path, shards: bool = True) -> Resumable:
    """The checkpoint to resume from at ``path``: the file or folder itself (which must be
    valid), or a folder's newest one that reads back and verifies, with the newer ones it
    skipped and why. ``shards=False``: a sharded checkpoint's shard files are checked by size,
    not read (for a rank that only needs to know where the run resumed)."""
    candidates = _candidates(path)
    if len(candidates) == 1 and candidates[0] == Path(path):
        try:
            return Resumable(candidates[0], _read(candidates[0], shards))
        except CheckpointProblem as problem:
            raise ConfigError(f"loop.resume: {str(path)!r} is {problem}") from None
    skipped: list[tuple[Path, str]] = []
    for candidate in candidates:
        try:
            return Resumable(candidate, _read(candidate, shards), skipped)
        except CheckpointProblem as problem:
            skipped.append((candidate, str(problem)))
    reasons = "; ".join(f"{p.name} is {why}" for p, why in skipped)
    raise ConfigError(f"loop.resume: {str(path)!r} holds no valid checkpoint: {reasons}")


def find_checkpoint(path: str | Path) -> Path:
    """The newest valid checkpoint at ``path`` (a checkpoint file or folder, a run dir, or its
    checkpoints/ dir)."""
    return newest_valid_checkpoint(path).path


def resume_source(ctx: CommContext, job: JobInfo, resume: str | None,
                  over: ParallelMode | None = ParallelMode.GLOBAL) -> Resumable | None:
    """The checkpoint this run starts from, the same on every rank of ``over``, or None for a
    fresh start: after a restart by the agent this run's newest valid checkpoint, else
    ``loop.resume``'s. ``over=None``: this rank's own restart count, nobody asked (an elastic
    run's rollout ranks: the trainers' weights and statistics reach them with the first
    transfer, the checkpoint only tells them where the run resumed: a sharded checkpoint's
    shard files are checked by size, never read)."""
    # Every rank resumes alike: a host restarted by hand joins with a new torchrun, whose
    # restart count (0) is not the others'.
    counts = torch.tensor([job.env.restart_count])
    restarted = job.env.restart_count if over is None else int(
        collectives.all_reduce(ctx, over, counts, torch.distributed.ReduceOp.MAX))
    picked: Resumable | None = None
    shards = over is not None  # a rollout rank of an elastic run reads no shard
    if restarted > 0:
        with contextlib.suppress(NoCheckpointError):  # failed before its first checkpoint
            picked = newest_valid_checkpoint(job.run_dir, shards)
        if picked is not None:  # nobody checked this one before: rank 0 warns on the console
            level = logging.WARNING if ctx.get_global_rank() == 0 else logging.INFO
            for note in picked.notes():
                log.log(level, "%s", note)
            return picked
    if resume:
        picked = newest_valid_checkpoint(resume, shards)
        for note in picked.notes():  # the launcher showed them already: the log files only
            log.info("%s", note, extra=FILE_ONLY)
    return picked


# ---- writing -------------------------------------------------------------------------------


def last_checkpoint_note(folder: Path) -> str:
    """Names the newest complete checkpoint in ``folder`` (renames are atomic: every
    ``ckpt_*.pt`` and ``ckpt_*/`` is whole), for the error of a write that failed."""
    found = sorted((p for p in folder.glob("ckpt_*") if is_checkpoint(p)),
                   key=lambda p: (update_of(p), p.name))
    return (f"the last checkpoint is {found[-1].name}" if found
            else "no checkpoint was written before")


def named_write_error(err: OSError, final: Path, partial: Path, folder: Path) -> OSError:
    """``err`` naming the checkpoint it lost (a file inside ``partial`` by its final name) and
    noting the last complete one, for the launcher's line."""
    name = os.fsdecode(err.filename) if err.filename is not None else None
    if name is None or Path(name) == partial:  # a write through a handle names none
        err.filename = str(final)
    elif Path(name).is_relative_to(partial):
        err.filename = str(final / Path(name).relative_to(partial))
    err.add_note(last_checkpoint_note(folder))
    return err


def snapshot(
    policy: torch.nn.Module | Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | Mapping[str, Any],
    state: TrainingState,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a flat checkpoint holds, as of now, without its checksum: copies of every tensor
    the trainer goes on changing (the policy, the normalisers' statistics, the optimizer's
    state), so that it can be written while training goes on (:func:`write_checkpoint`)."""
    if isinstance(policy, torch.nn.Module):
        policy = policy.state_dict()
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.state_dict()
    written: dict[str, Any] = {
        # Clones: the parameters and the statistics are views of the (larger) send buffer.
        "policy": {k: v.clone() for k, v in policy.items()},
        "normalizers": {k: v.clone() for k, v in state.normalizers.items()},
        "optimizer": cloned(optimizer),
        "update": state.update,
        "env_steps": state.env_steps,
        "epoch": state.epoch,  # the membership epoch of an elastic run (rlcomm.elastic), else None
        "episodes": list(state.episodes),
        "episodes_done": state.episodes_done,
        "history": dict(state.history),
        "train_s": state.train_s,
        "reached_at": state.reached_at,
        # Minibatch order is seeded per update and environments restart from their seeds.
        "torch_rng": torch.get_rng_state(),
        "format": FORMAT,
        "settings": dict(state.settings),
        **(extra or {}),
    }
    if state.algorithm:
        written["algorithm"] = dict(state.algorithm)
    return written


def cloned(obj: Any) -> Any:
    """``obj`` with every tensor in it copied (containers rebuilt, other values shared)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {key: cloned(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [cloned(item) for item in obj]
    if isinstance(obj, tuple):
        return tuple(cloned(item) for item in obj)
    return obj


def checkpoint_content(
    policy: torch.nn.Module | Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | Mapping[str, Any],
    state: TrainingState,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a flat checkpoint holds, with its checksum: sent whole to a joining trainer
    (app/runtime/membership/healing.py)."""
    return with_checksum(snapshot(policy, optimizer, state, extra))


def with_checksum(content: dict[str, Any]) -> dict[str, Any]:
    content["checksum"] = content_checksum(content)
    return content


def checkpoint_path(run_dir: Path, update: int, name: str | None = None) -> Path:
    """Where the flat checkpoint of ``update`` (or ``name``: ``best``) is written."""
    return run_dir / CHECKPOINT_DIR / (name or f"ckpt_{update:06d}.pt")


def write_checkpoint(final: Path, content: dict[str, Any], clear_stale: bool = False) -> Path:
    """Writes the snapshot ``content`` to ``final`` with its checksum: written aside
    (``.tmp``), synced, renamed; a failed write removes it and re-raises, an OSError noting the
    last complete checkpoint. Safe off the training thread: ``content`` is the trainer's no
    longer (:func:`snapshot`). ``clear_stale``: first remove the ``*.tmp`` a rank killed inside
    a write left (a process's first write: none of its own can be in flight then)."""
    folder = final.parent
    partial = final.with_suffix(".tmp")
    try:
        written = with_checksum(content)
        folder.mkdir(parents=True, exist_ok=True)
        if clear_stale:
            remove_stale(folder)
        write_synced(partial, written)
        os.replace(partial, final)
    except BaseException as err:  # an interrupt too: no partial file survives
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        if isinstance(err, OSError):  # the launcher's line names the checkpoint it lost
            named_write_error(err, final, partial, folder)
        raise
    sync_folder(folder)
    log.info("checkpoint %s (update %d, %d env steps)", final.name, written["update"],
             written["env_steps"])
    return final


def save_checkpoint(
    run_dir: Path,
    policy: torch.nn.Module | Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | Mapping[str, Any],
    state: TrainingState,
    name: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Writes ``ckpt_<update>.pt`` (or ``name``: ``best``) now, in this thread: a
    :func:`snapshot` written by :func:`write_checkpoint`. ``policy`` and ``optimizer``: the
    modules, or their whole state dicts (a sharded trainer's, gathered)."""
    return write_checkpoint(checkpoint_path(run_dir, state.update, name),
                            snapshot(policy, optimizer, state, extra))
