"""What an algorithm and the runtime say of a replay, below both: ``loop.replay``'s settings
(:class:`ReplaySettings`), a sampled :class:`Batch`, and what an off-policy algorithm sees of
its replay (:class:`ReplayClient`), wherever the replay lives. The replay itself (shards, the
rate limiter, replay ranks) is app/runtime/replay/'s."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from app.api import setting
from app.runtime.core.data import Segment


@dataclass
class ReplaySettings:
    """``loop.replay``: one trainer's replay shard and the rate between learning and collecting."""

    capacity: int = setting(10_000, "transitions per trainer shard, or per replay rank "
                            "(layout.replay); the oldest go first (FIFO)")
    batch_size: int = setting(128, "transitions per learner step")
    min_size: int = setting(1_000, "transitions of the whole run (every shard together, as "
                            "CleanRL's learning_starts) before the learner starts; each of "
                            "the run's shards waits for its share")
    samples_per_insert: float = setting(
        8.0, "sampled transitions per inserted transition (> 0), held by the rate limiter")
    tolerance: float = setting(
        128.0, "how many samples the learner may run ahead of or behind samples_per_insert; at "
        "least (batch_size + samples_per_insert) / 2, so that one side can always go on")
    n_step: int = setting(1, "steps summed into a transition's return (1 .. the segment's steps)")
    checkpoint: bool = setting(
        False, "save each replay shard (its transitions, priorities and the limiter's counts) "
        "beside every checkpoint and load it on resume; off, a resumed run refills its replay "
        "(a shard of capacity transitions can take GBs: its size is shown at launch)")
    prioritized: bool = setting(False, "sample in proportion to priority ** priority_exponent")
    priority_exponent: float = setting(0.6, "alpha of prioritized replay, in [0, 1]")
    importance_exponent: float = setting(0.4, "beta of the importance weights, in [0, 1]")

    def shard_min_size(self, shards: int) -> int:
        """Transitions one of ``shards`` shards holds before its learner steps: its share of
        ``min_size``, rounded up (the shards fill alike: each trainer's, or each replay rank's)."""
        return -(-self.min_size // max(shards, 1))

    def range_errors(self, segment_steps: int, shards: int = 1) -> list[str]:
        """Out-of-range settings as ``replay.<field>: must be ..., got value`` (empty when all
        fit); ``segment_steps``: the steps per env of one segment (``hparams.num_steps``);
        ``shards``: the run's replay shards (trainers, or replay ranks), among which
        ``min_size`` is shared."""
        checks = [
            ("capacity", self.capacity >= 1, "a positive integer"),
            ("batch_size", self.batch_size >= 1, "a positive integer"),
            ("min_size", self.min_size >= 0, ">= 0"),
            ("samples_per_insert", self.samples_per_insert > 0, "> 0"),
            ("tolerance", self.tolerance >= 0, ">= 0"),
            ("n_step", 1 <= self.n_step <= max(segment_steps, 1),
             f"in [1, {segment_steps}] (a segment's steps, hparams.num_steps)"),
            ("priority_exponent", 0 <= self.priority_exponent <= 1, "in [0, 1]"),
            ("importance_exponent", 0 <= self.importance_exponent <= 1, "in [0, 1]"),
        ]
        errors = [f"replay.{name}: must be {want}, got {getattr(self, name)}"
                  for name, ok, want in checks if not ok]
        if errors:
            return errors
        if self.capacity < self.batch_size:
            errors.append(f"replay.capacity: must be at least batch_size ({self.batch_size}), "
                          f"got {self.capacity}")
        if self.capacity < self.shard_min_size(shards):
            held = f"{shards} shards x capacity" if shards > 1 else "capacity"
            errors.append(f"replay.min_size: must be at most {held} "
                          f"({shards * self.capacity}), got {self.min_size}")
        least = (self.batch_size + self.samples_per_insert) / 2
        if self.tolerance < least:
            errors.append(f"replay.tolerance: must be at least (batch_size + samples_per_insert)"
                          f" / 2 = {least:g}, so that the learner or the collectors can always "
                          f"go on, got {self.tolerance}")
        return errors


@dataclass
class Batch:
    """B sampled transitions, as the learner sees them."""

    obs: Tensor  # [B, *obs]
    actions: Tensor  # [B, *action]
    rewards: Tensor  # [B] the n-step discounted reward sum
    next_obs: Tensor  # [B, *obs] the observation the summed steps lead to
    discounts: Tensor  # [B] gamma ** k for the k steps summed; 0 where the episode terminated
    weights: Tensor  # [B] importance weights, max-normalised (ones when uniform)
    indices: Tensor  # [B] int64 slots, for Replay.update_priorities
    extras: dict[str, Tensor] = field(default_factory=dict)  # the algorithm's records, [B, ...]


class ReplayClient(Protocol):
    """An off-policy algorithm's replay, as its update uses it
    (app/runtime/replay/offpolicy.py)."""

    #: ``loop.replay``.
    settings: ReplaySettings

    @property
    def inserts(self) -> int:
        """Transitions inserted over the run."""

    @property
    def samples(self) -> int:
        """Transitions sampled over the run."""

    @property
    def size(self) -> int:
        """Transitions held now."""

    def insert(self, segment: Segment) -> int:
        """The segment's transitions into the replay; returns how many this rank wrote."""

    def sample(self, generator: torch.Generator) -> Batch:
        """One learner batch (``batch_size`` transitions)."""

    def update_priorities(self, indices: Tensor, priorities: Tensor) -> None:
        """New priorities (e.g. |TD error|) for the last batch's ``indices``."""

    def steps_allowed(self) -> int:
        """The learner steps the rate limiter allows now."""

    def steps_to_admit(self, count: int, most: int) -> int:
        """The fewest learner steps (at most ``most``) after which collectors may insert
        ``count`` more transitions (:meth:`RateLimiter.steps_to_admit`), on the counts as
        :meth:`steps_allowed` left them."""

    def figures(self) -> dict[str, float]:
        """``replay_size``, ``replay_inserts``, ``replay_samples``, ``samples_per_insert``
        (the ratio held since sampling began) and ``priority_spread``."""

    def state_dict(self) -> dict[str, Any]:
        """The counters a checkpoint keeps."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's counters; the rate limiter counts on from them."""
