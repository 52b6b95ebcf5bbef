"""A joining trainer heals from the lead trainer, not from disk.

At the update boundary where the trainers admitted it (app/runtime/membership/trainers.py) the lead
sends its whole state over the new TRAIN_DATA_PARALLEL group, as a flat checkpoint holds it
(app/runtime/checkpoints/checkpoint.py's ``checkpoint_content``, with its checksum): the
weights, the optimizer's state, the normalisers' statistics, the algorithm's own state, the
counters, the finished episodes, the seconds trained and the torch RNG. The joiner checks the
content's checksum, loads it, and then every trainer compares a checksum of its live weights,
optimizer state and statistics: the joiner takes its first step only when they are equal.
"""

from __future__ import annotations

import io
import logging
from typing import Any

import torch

from app.runtime.checkpoints.checkpoint import content_checksum
from app.runtime.checkpoints.checkpointer import Checkpointer, restore_counters, restore_history
from app.runtime.core.state import RunState
from rlcomm import CommContext, ParallelMode, collectives

log = logging.getLogger(__name__)
TDP = ParallelMode.TRAIN_DATA_PARALLEL


class HealError(RuntimeError):
    """A joining trainer's state differs from the live trainers' after it healed."""


def heal(ctx: CommContext, checkpointer: Checkpointer, state: RunState, lead: int,
         joined: list[int]) -> None:
    """The lead's state to the trainers in ``joined``, then every trainer's checksum compared;
    called on every trainer of the group that just admitted them."""
    rank = ctx.get_global_rank()
    # A sharded trainer's whole state is gathered over its replica group's grid: every rank of
    # the lead's takes part (and of every other replica group that keeps its state).
    gathers = rank == lead or (checkpointer.trainer.trained.sharded and rank not in joined)
    content = checkpointer.content(state) if gathers else None
    payload = _pack(content) if rank == lead and content is not None else None
    received = _broadcast_bytes(ctx, payload, lead)
    if rank in joined:
        content = torch.load(io.BytesIO(received), weights_only=False)
        if content_checksum(content) != content["checksum"]:
            raise HealError(f"rank {rank} (trainer): the state it received from rank {lead} "
                            "does not match its own checksum")
        checkpointer.load_content(content)
        restore_counters(content, checkpointer.trainer.agent, state)
        restore_history(content, state)
    checksums = _checksums(ctx, checkpointer)
    trainers = ctx.get_ranks_in_group(TDP)
    if len(set(checksums)) != 1:
        table = ", ".join(f"rank {r}: {c:016x}" for r, c in zip(trainers, checksums))
        raise HealError(f"after healing rank(s) {joined} from rank {lead}, the trainers' states "
                        f"differ ({table})")
    if rank == lead:
        log.warning("rank%s %s (trainer) healed from rank %d at update %d: %d bytes, checksum "
                    "%016x equal on the trainers %s", "s" if len(joined) > 1 else "",
                    ", ".join(map(str, joined)), lead, state.update, len(received), checksums[0],
                    trainers)


def settle(ctx: CommContext, checkpointer: Checkpointer, state: RunState, lead: int) -> None:
    """After the trainers' group changed during an update: the trainers whose state differs
    from the lead's heal from it. With three or more, gloo can complete for some trainers a
    collective that the lost one broke for the others, which then made the update again."""
    ranks = ctx.get_ranks_in_group(TDP)
    checksums = _checksums(ctx, checkpointer)
    ahead = [r for r, c in zip(ranks, checksums) if c != checksums[ranks.index(lead)]]
    if ahead:
        log.warning("ranks %s (trainers) differ from rank %d after the trainers changed", ahead,
                    lead)
        heal(ctx, checkpointer, state, lead, ahead)


def _pack(content: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(content, buffer)
    return buffer.getvalue()


def _broadcast_bytes(ctx: CommContext, payload: bytes | None, src: int) -> bytes:
    """``payload`` from ``src`` to every trainer, as a length and then the bytes."""
    length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
    collectives.broadcast(ctx, TDP, length, src=src)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
            else torch.empty(int(length.item()), dtype=torch.uint8))
    collectives.broadcast(ctx, TDP, data, src=src)
    return data.numpy().tobytes()


def live_checksum(checkpointer: Checkpointer) -> int:
    """A checksum of what must be equal on every trainer: the weights, the optimizer's state
    and the normalisers' statistics (63 bits of their SHA-256)."""
    trainer = checkpointer.trainer
    policy, optimizer = trainer.trained.state_dicts(trainer.optimizer)
    digest = content_checksum({"policy": policy, "optimizer": optimizer,
                               "normalizers": trainer.agent.normalizers()})
    return int(digest[:15], 16)


def _checksums(ctx: CommContext, checkpointer: Checkpointer) -> list[int]:
    mine = torch.tensor([live_checksum(checkpointer)], dtype=torch.int64)
    return [int(c) for c in collectives.all_gather(ctx, TDP, mine).tolist()]
