"""Which of a context's modes hold a membership epoch's group (``CommContext.epochs``).

An epoch's group replaces the mode's group before it in the context (rlcomm's collectives and
weight transfers then use it), validated by :func:`rlcomm.elastic.epochs.build_epoch_group`.
It is not in torch's world maps, so its calls take group ranks: the collectives ask
:meth:`EpochGroups.holds`. The group a newer epoch replaced is kept for the life of the process:
gloo cannot abort a group, and freeing one while a transfer on it is still posted (a lost
member's) frees memory that transfer goes on using.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcomm.modes import Mode, mode_name
from rlcomm.recovery import Broken

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from rlcomm.context import CommContext


class EpochGroups:
    """One context's epoch groups, by mode."""

    def __init__(self) -> None:
        self._modes: set[str] = set()
        self._retired: list[Any] = []

    def register(self, ctx: CommContext, mode: Mode, group: ProcessGroup, ranks: list[int],
                 broken: Broken | None = None) -> None:
        """Make ``group``, a membership epoch's (``ranks``: leader first, in group-rank order),
        ``ctx``'s group of ``mode``, replacing the one before. ``broken()``: whether a member
        declared the group broken (a call of rlcomm.collectives waiting on it then gives up:
        gloo sees a lost member only on the connections to it, so the others could wait out the
        group's timeout)."""
        ctx.recovery.watch(mode, broken)
        replaced = ctx.replace_group(mode, group, ranks)
        if replaced is not None and mode_name(mode) in self._modes:
            self._retired.append(replaced)
        self._modes.add(mode_name(mode))

    def holds(self, mode: Mode) -> bool:
        """Whether ``mode``'s group is an epoch's: members come and go."""
        return mode_name(mode) in self._modes
