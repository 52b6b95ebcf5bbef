"""PPO checkpoints: ``<run dir>/checkpoints/ckpt_<update>.pt``, written by rank 0 (a trainer),
read by every rank on resume (``loop.resume``, or the agent restarting a failed run)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from app.api import ConfigError, JobInfo
from rlcomm import CommContext, ParallelMode, collectives

log = logging.getLogger(__name__)
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_KEYS = ("policy", "optimizer", "update", "env_steps", "episodes", "metrics", "torch_rng")


def find_checkpoint(path: str | Path) -> Path:
    """The newest checkpoint at ``path`` (a file, a run dir, or its checkpoints/ dir)."""
    target = Path(path)
    if target.is_file():
        return target
    if not target.exists():
        raise ConfigError(f"loop.resume: {str(path)!r} does not exist")
    found = sorted(target.glob(f"{CHECKPOINT_DIR}/ckpt_*.pt")) + sorted(target.glob("ckpt_*.pt"))
    if not found:
        raise ConfigError(f"loop.resume: {str(path)!r} holds no checkpoint (ckpt_*.pt)")
    return max(found, key=lambda p: p.name)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint's state; tensors and plain containers only (``weights_only``: no code)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConfigError(
            f"loop.resume: {str(path)!r} is not a readable checkpoint ({type(err).__name__})"
        ) from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ConfigError(f"loop.resume: {str(path)!r} is not a PPO checkpoint (missing {missing})")
    return state


def save_checkpoint(
    run_dir: Path,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    update: int,
    env_steps: int,
    episodes: list[tuple[float, int]],
    metrics: list[dict[str, float]],
) -> Path:
    """Writes ``ckpt_<update>.pt`` (never half-written: saved aside, then renamed)."""
    folder = run_dir / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        # Clones: the parameters are views of the (larger) send buffer.
        "policy": {k: v.clone() for k, v in policy.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "update": update,
        "env_steps": env_steps,
        "episodes": episodes,
        "metrics": metrics,
        # Minibatch order needs no state (seeded per update); environments restart from
        # their seeds on resume, so only torch's global RNG is carried.
        "torch_rng": torch.get_rng_state(),
    }
    for stale in folder.glob("*.tmp"):  # left by a rank killed inside torch.save
        stale.unlink(missing_ok=True)
    final = folder / f"ckpt_{update:06d}.pt"
    partial = final.with_suffix(".tmp")
    torch.save(state, partial)
    os.replace(partial, final)
    log.info("checkpoint %s (update %d, %d env steps)", final.name, update, env_steps)
    return final


def resume_source(ctx: CommContext, job: JobInfo, resume: str | None) -> Path | None:
    """The checkpoint this run starts from, the same on every rank, or None for a fresh start:
    after a restart by the agent this run's newest checkpoint, else ``loop.resume``'s."""
    # Every rank resumes alike: a host restarted by hand joins with a new torchrun, whose
    # restart count (0) is not the others'.
    counts = torch.tensor([job.env.restart_count])
    restarted = int(collectives.all_reduce(ctx, ParallelMode.GLOBAL, counts,
                                           torch.distributed.ReduceOp.MAX))
    if restarted > 0:
        try:
            return find_checkpoint(job.run_dir)
        except ConfigError:
            pass  # failed before its first checkpoint
    return find_checkpoint(resume) if resume else None
