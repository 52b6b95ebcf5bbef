"""When a trainer checkpoints (``loop.checkpoint_every``, ``loop.checkpoint_every_s``) and
which checkpoints it keeps (``loop.checkpoint_keep``, ``loop.milestone_every``,
``loop.milestone_every_s``): docs/data-safety.md, "Cadence and retention".

- ``checkpoint_every``: null (the default) checkpoints every ``checkpoint_every_s`` seconds of
  training; N > 0, every N updates instead (the time cadence is then off: a user who names
  updates gets checkpoints at those updates); 0, no checkpoints at all, not even the last.
- With checkpoints on, a run also checkpoints at its end and when it is asked to stop
  (SIGTERM), unless the last update's checkpoint already holds that state.
"""

from __future__ import annotations

from dataclasses import dataclass

# The time cadence's default: a crash loses at most a minute of training, and the snapshot and
# background write cost the update loop well under 1% of that (docs/data-safety.md).
DEFAULT_INTERVAL_S = 60.0
DEFAULT_KEEP = 3


@dataclass(frozen=True)
class Cadence:
    """``loop.checkpoint_every``, ``checkpoint_every_s``, ``checkpoint_keep``,
    ``milestone_every`` and ``milestone_every_s``, as a trainer applies them."""

    every: int | None = None
    every_s: float = DEFAULT_INTERVAL_S
    keep: int = DEFAULT_KEEP
    milestone_every: int = 0
    milestone_every_s: float = 0.0

    @property
    def on(self) -> bool:
        """Whether the run checkpoints at all."""
        return self.every != 0

    def due(self, update: int, trained_s: float, last: tuple[int, float] | None) -> bool:
        """Whether this rank finds a checkpoint due after ``update`` at ``trained_s`` seconds
        of training, the last checkpoint (or the run's start) at ``last`` (update, seconds)."""
        if self.every is not None:
            return self.every > 0 and update % self.every == 0
        since = trained_s - (last[1] if last is not None else 0.0)
        return self.every_s > 0 and since >= self.every_s

    def range_errors(self) -> list[str]:
        """Out-of-range values as ``<field>: must be ..., got value``."""
        checks = [
            ("checkpoint_every", self.every is None or self.every >= 0, ">= 0 (or null)",
             self.every),
            ("checkpoint_every_s", self.every_s >= 0, ">= 0", self.every_s),
            ("checkpoint_keep", self.keep >= 0, ">= 0", self.keep),
            ("milestone_every", self.milestone_every >= 0, ">= 0", self.milestone_every),
            ("milestone_every_s", self.milestone_every_s >= 0, ">= 0", self.milestone_every_s),
        ]
        errors = [f"{name}: must be {want}, got {value}" for name, ok, want, value in checks
                  if not ok]
        if not errors and self.on and self.keep == 0:
            errors.append("checkpoint_keep: must be >= 1 while checkpoints are on "
                          "(loop.checkpoint_every=0 turns them off), got 0")
        return errors
