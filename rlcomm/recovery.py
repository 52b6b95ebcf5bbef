"""Per mode of a context: what re-forms its group when a call on it failed, and whether its
members declared it broken (rlcomm.collectives reads both; ``CommContext.recovery``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .modes import Mode, mode_name

Recover = Callable[[BaseException], bool]  # registers the mode's next group (True), or cannot
Broken = Callable[[], bool]  # whether a member declared the mode's group broken
Commit = Callable[[], None]  # after a call completed here: returns once every member's did


class Recoveries:
    """The recoveries of one context's modes (elastic groups: membership epochs)."""

    def __init__(self) -> None:
        self._recover: dict[str, Recover] = {}
        self._broken: dict[str, Broken] = {}
        self._commit: dict[str, Commit] = {}

    def set(self, mode: Mode, recover: Recover | None) -> None:
        """``recover(err)``: called when a call of rlcomm.collectives on ``mode``'s group failed
        with ``err``; it registers the next group of the mode (True: the call runs again on it)
        or returns False (the error stands). None: none."""
        self._put(self._recover, mode, recover)

    def watch(self, mode: Mode, broken: Broken | None) -> None:
        """``broken()``: whether a member declared ``mode``'s current group broken (a call
        waiting on it then gives up: gloo tells only the members connected to a lost one)."""
        self._put(self._broken, mode, broken)

    def commit_with(self, mode: Mode, commit: Commit | None) -> None:
        """``commit()``: called after each call on ``mode``'s group completed on this rank; it
        returns once the call completed on every member, and raises (a RuntimeError) when a
        member declared the group broken first, so that the call counts as failed on every
        member alike. gloo can complete a collective for some members that a lost one broke for
        the others: without it, those would go on one call ahead (to block, say, on a
        tensor-parallel peer that waits in the recovery)."""
        self._put(self._commit, mode, commit)

    def commit(self, mode: Mode) -> None:
        commit = self._commit.get(mode_name(mode))
        if commit is not None:
            commit()

    def recovers(self, mode: Mode) -> bool:
        return mode_name(mode) in self._recover

    def recover(self, mode: Mode, err: BaseException) -> bool:
        """The mode's recovery after ``err``; False where it has none."""
        recover = self._recover.get(mode_name(mode))
        return recover is not None and recover(err)

    def broken(self, mode: Mode) -> Broken | None:
        return self._broken.get(mode_name(mode))

    @staticmethod
    def _put(table: dict[str, Callable[..., Any]], mode: Mode,
             value: Callable[..., Any] | None) -> None:
        if value is None:
            table.pop(mode_name(mode), None)
        else:
            table[mode_name(mode)] = value
