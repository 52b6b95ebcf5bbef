"""Checkpoints: ``<run dir>/checkpoints/ckpt_<update>.pt``, written by rank 0 (a trainer), read
by every rank on resume (``loop.resume``, or the agent restarting a failed run). A checkpoint
holds everything the runtime owns: the policy, the normalisers' statistics, the optimizer, the
counters, the episodes and the metrics rows.

A checkpoint proves itself: it carries a SHA-256 of its content (every tensor's bytes and every
value, walked in a fixed order, so the digest does not depend on torch's file format) and the
settings it was written with (:func:`run_settings`). The launcher compares those settings with
the run's before any rank starts (:func:`resume_mismatch`); a resume from a folder takes its
newest checkpoint that reads back and verifies, skipping (and naming) any that does not.
Checkpoints written before checksums (no ``checksum`` key) are accepted with a note: only their
tensor shapes can be compared.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import numbers
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.api import ConfigError, JobInfo
from app.output.logs import FILE_ONLY
from rlcomm import CommContext, ParallelMode, collectives

log = logging.getLogger(__name__)
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_KEYS = ("policy", "optimizer", "update", "env_steps", "episodes", "metrics", "torch_rng")
# Format 2: a checksum and the settings of the run that wrote it. Format 1 (no "format" key):
# neither.
FORMAT = 2


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


# ---- what must agree between a checkpoint and the run resuming it ----------------------------


def describe_space(space: Any) -> str:
    """A gymnasium space in a few words: its kind, size, shape and dtype (not its bounds)."""
    kind = type(space).__name__
    if hasattr(space, "n"):  # Discrete, MultiBinary
        return f"{kind}({int(space.n)})" if np.ndim(space.n) == 0 else f"{kind}({space.n.tolist()})"
    return f"{kind}(shape={tuple(space.shape) if space.shape is not None else None}, dtype={space.dtype})"


def run_settings(loop: Any, spaces: Any) -> dict[str, Any]:
    """Everything a resumed run must share with the checkpoint, by the name a user knows it:
    the algorithm (the loop's class, i.e. ``loop._target_``), the environment (its id, factory,
    spaces and which normalisers it has), every algorithm setting (the model's shape and what an
    update does) and the policy's (``loop.model``). Everything else (layout and trainer grid,
    ``loop.data_parallel``, budget, target, window, checkpoint_every,
    staleness, logging, seed, the vector env kind) may change."""
    target = type(loop)
    env = loop.env
    return {
        "loop._target_": f"{target.__module__}.{target.__qualname__}",
        "env.id": env.id,
        **({"env._target_": env._target_} if env._target_ else {}),
        "env.observation_space": describe_space(spaces.observation),
        "env.action_space": describe_space(spaces.action),
        "env.normalize_obs": env.normalize_obs,
        "env.normalize_reward": env.normalize_reward,
        **{f"loop.hparams.{name}": value for name, value in asdict(loop.hp).items()},
        **{f"loop.model.{name}": value for name, value in asdict(loop.model).items()},
    }


def policy_shapes(policy: torch.nn.Module) -> dict[str, list[int]]:
    """The shape of every tensor of ``policy``."""
    return {name: list(t.shape) for name, t in policy.state_dict().items()}


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def resume_mismatch(state: Mapping[str, Any], settings: Mapping[str, Any],
                    shapes: Mapping[str, list[int]]) -> str | None:
    """The first disagreement between a checkpoint and this run, as one line, or None.
    Settings the checkpoint does not record (an old checkpoint, a setting added since) are not
    compared; the policy's tensor shapes always are."""
    saved = state.get("settings") or {}
    for key, value in settings.items():
        if key in saved and saved[key] != value:
            return f"loop.resume: checkpoint has {key}={_shown(saved[key])}, this run {_shown(value)}"
    policy = state["policy"]
    for name, shape in shapes.items():
        if name not in policy:
            return f"loop.resume: checkpoint has no policy tensor {name}, this run {shape}"
        if list(policy[name].shape) != shape:
            return (f"loop.resume: checkpoint has policy tensor {name} of shape "
                    f"{list(policy[name].shape)}, this run {shape}")
    extra = sorted(set(policy) - set(shapes))
    if extra:
        return f"loop.resume: checkpoint has policy tensor {extra[0]}, this run none"
    return None


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


def _read(path: Path) -> dict[str, Any]:
    """A checkpoint's state, verified; raises CheckpointProblem saying why it cannot be used."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:120]
        raise CheckpointProblem(
            f"not a readable checkpoint (truncated or corrupt: {type(err).__name__}: {first})"
        ) from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointProblem(f"not a checkpoint of this runtime (missing {missing})")
    if "checksum" in state and state["checksum"] != content_checksum(state):
        raise CheckpointProblem("corrupt (its content does not match its checksum)")
    return state


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's state, its checksum verified; tensors and plain containers only
    (``weights_only``: no code)."""
    try:
        return _read(path)
    except CheckpointProblem as problem:
        raise ConfigError(f"loop.resume: {str(path)!r} is {problem}") from None


def _candidates(path: str | Path) -> list[Path]:
    """The checkpoint files at ``path``, newest first (``*.tmp`` never counts)."""
    target = Path(path)
    if target.is_file():
        return [target]
    if not target.exists():
        raise ConfigError(f"loop.resume: {str(path)!r} does not exist")
    found = sorted(target.glob(f"{CHECKPOINT_DIR}/ckpt_*.pt")) + sorted(target.glob("ckpt_*.pt"))
    if not found:
        raise NoCheckpointError(f"loop.resume: {str(path)!r} holds no checkpoint (ckpt_*.pt)")
    return sorted(found, key=lambda p: p.name, reverse=True)


def newest_valid_checkpoint(path: str | Path) -> Resumable:
    """The checkpoint to resume from at ``path``: the file itself (which must be valid), or a
    folder's newest one that reads back and verifies, with the newer ones it skipped and why."""
    candidates = _candidates(path)
    if len(candidates) == 1 and candidates[0] == Path(path):
        return Resumable(candidates[0], load_checkpoint(candidates[0]))
    skipped: list[tuple[Path, str]] = []
    for candidate in candidates:
        try:
            return Resumable(candidate, _read(candidate), skipped)
        except CheckpointProblem as problem:
            skipped.append((candidate, str(problem)))
    reasons = "; ".join(f"{p.name} is {why}" for p, why in skipped)
    raise ConfigError(f"loop.resume: {str(path)!r} holds no valid checkpoint: {reasons}")


def find_checkpoint(path: str | Path) -> Path:
    """The newest valid checkpoint at ``path`` (a file, a run dir, or its checkpoints/ dir)."""
    return newest_valid_checkpoint(path).path


def resume_source(ctx: CommContext, job: JobInfo, resume: str | None,
                  over: ParallelMode | None = ParallelMode.GLOBAL) -> Resumable | None:
    """The checkpoint this run starts from, the same on every rank of ``over``, or None for a
    fresh start: after a restart by the agent this run's newest valid checkpoint, else
    ``loop.resume``'s. ``over=None``: this rank's own restart count, nobody asked (an elastic
    run's rollout ranks: the trainers' weights and statistics reach them with the first
    transfer, the checkpoint only tells them where the run resumed)."""
    # Every rank resumes alike: a host restarted by hand joins with a new torchrun, whose
    # restart count (0) is not the others'.
    counts = torch.tensor([job.env.restart_count])
    restarted = job.env.restart_count if over is None else int(
        collectives.all_reduce(ctx, over, counts, torch.distributed.ReduceOp.MAX))
    picked: Resumable | None = None
    if restarted > 0:
        with contextlib.suppress(NoCheckpointError):  # failed before its first checkpoint
            picked = newest_valid_checkpoint(job.run_dir)
        if picked is not None:  # nobody checked this one before: rank 0 warns on the console
            level = logging.WARNING if ctx.get_global_rank() == 0 else logging.INFO
            for note in picked.notes():
                log.log(level, "%s", note)
            return picked
    if resume:
        picked = newest_valid_checkpoint(resume)
        for note in picked.notes():  # the launcher showed them already: the log files only
            log.info("%s", note, extra=FILE_ONLY)
    return picked


# ---- writing -------------------------------------------------------------------------------


def last_checkpoint_note(folder: Path) -> str:
    """Names the newest complete checkpoint in ``folder`` (renames are atomic: every
    ``ckpt_*.pt`` is whole), for the error of a write that failed."""
    found = sorted(p.name for p in folder.glob("ckpt_*.pt") if p.is_file())
    return f"the last checkpoint is {found[-1]}" if found else "no checkpoint was written before"


def save_checkpoint(
    run_dir: Path,
    policy: torch.nn.Module | Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | Mapping[str, Any],
    update: int,
    env_steps: int,
    episodes: list[tuple[float, int]],
    metrics: list[dict[str, float]],
    settings: Mapping[str, Any] | None = None,
    normalizers: Mapping[str, torch.Tensor] | None = None,
    epoch: int | None = None,
) -> Path:
    """Writes ``ckpt_<update>.pt`` with its checksum and ``settings`` (:func:`run_settings`).
    Never half-written: written aside (``.tmp``), synced, then renamed; a failed write removes
    its ``.tmp`` and re-raises, an OSError noting the last complete checkpoint. ``policy`` and
    ``optimizer``: the modules, or their whole state dicts (a sharded trainer's, gathered)."""
    folder = run_dir / CHECKPOINT_DIR
    if isinstance(policy, torch.nn.Module):
        policy = policy.state_dict()
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.state_dict()
    state: dict[str, Any] = {
        # Clones: the parameters are views of the (larger) send buffer.
        "policy": {k: v.clone() for k, v in policy.items()},
        # The observation and reward statistics (bound to the send buffer too: cloned).
        "normalizers": {k: v.clone() for k, v in (normalizers or {}).items()},
        "optimizer": dict(optimizer),
        "update": update,
        "env_steps": env_steps,
        "epoch": epoch,  # the membership epoch of an elastic run (rlcomm.elastic), else None
        "episodes": episodes,
        "metrics": metrics,
        # Minibatch order needs no state (seeded per update); environments restart from
        # their seeds on resume, so only torch's global RNG is carried.
        "torch_rng": torch.get_rng_state(),
        "format": FORMAT,
        "settings": dict(settings or {}),
    }
    state["checksum"] = content_checksum(state)
    # Serialised in memory, written with Python's file calls: a full disk is an OSError
    # (ENOSPC) naming the file, not a RuntimeError from torch's zip writer.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    final = folder / f"ckpt_{update:06d}.pt"
    partial = final.with_suffix(".tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.tmp"):  # left by a rank killed inside a write
            stale.unlink(missing_ok=True)
        with partial.open("wb") as handle:
            handle.write(buffer.getbuffer())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, final)
    except BaseException as err:  # an interrupt too: no partial file survives
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        if isinstance(err, OSError):
            if err.filename in (None, str(partial)):  # a write through the handle names none
                err.filename = str(final)  # the launcher's line names the checkpoint it lost
            err.add_note(last_checkpoint_note(folder))
        raise
    _sync_folder(folder)
    log.info("checkpoint %s (update %d, %d env steps)", final.name, update, env_steps)
    return final


def _sync_folder(folder: Path) -> None:
    """Makes the rename durable; best effort (not every filesystem syncs a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
