"""Membership as the hand-off sees it: who is in a group now, and how the group changes as
members leave and join.

A group has one leader and its members. The parts whose groups follow the membership (a
weight channel, a segment route: :class:`Follower`) are told when the first group forms, when
a group ends and when the next one forms. :class:`StaticMembership` never changes; the rollout
ranks' membership epochs (rlcomm.elastic's one membership, with the RL runtime's policy) are
app/runtime/membership/rollouts.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Follower(Protocol):
    """A part whose groups follow the membership's (a weight channel, a segment route)."""

    def begin(self, members: list[int]) -> None:
        """The first group formed."""
        ...

    def agree(self, changing: bool) -> bool:
        """Whether the group changes: where the part spans several leaders' groups, every
        leader must change with any of them."""
        ...

    def end(self, moved: bool, epoch: int) -> None:
        """Nothing more on this group (``moved``: the members go to ``epoch``)."""
        ...

    def renew(self, epoch: int, members: list[int]) -> None:
        """The group of ``epoch`` formed."""
        ...


class Unchanging:
    """A part with no group of its own to follow: the membership's changes leave it as is."""

    def begin(self, members: list[int]) -> None:
        """Nothing to open."""

    def agree(self, changing: bool) -> bool:
        return changing

    def end(self, moved: bool, epoch: int) -> None:
        """Nothing in flight to end."""

    def renew(self, epoch: int, members: list[int]) -> None:
        """Nothing to reopen."""


Transfer = Callable[[bool], None]  # one weights sync: sends or takes; ``first`` or not


class Membership(Protocol):
    """One rank's view of its group: the leader's or a member's."""

    on_wait: Callable[[str], None] | None  # told when the leader waits for members to join

    def begin(self, followers: list[Follower]) -> None:
        """Forms (or joins) the first group; ``followers`` follow every change of it."""
        ...

    def sync(self, transfer: Transfer, first: bool) -> bool:
        """One weights ``transfer`` at an update boundary, around the changes due there (a
        leader admits and drops; a member follows). False: the run stopped."""
        ...

    def update_done(self) -> None:
        """After each update: the times changes took to settle."""
        ...

    def stop(self, updates: int, env_steps: int) -> None:
        """The run stopped at ``updates``: whoever waits is told."""
        ...

    def result(self) -> dict[str, Any]:
        """This side's part of the rank's result.json entry."""
        ...


class StaticMembership:
    """A group that never changes: the layout's."""

    def __init__(self) -> None:
        self.on_wait: Callable[[str], None] | None = None  # nobody is ever waited for

    def begin(self, followers: list[Follower]) -> None:
        for follower in followers:
            follower.begin([])

    def sync(self, transfer: Transfer, first: bool) -> bool:
        transfer(first)
        return True

    def update_done(self) -> None:
        """Nothing to time."""

    def stop(self, updates: int, env_steps: int) -> None:
        """Every rank stopped at the same update: nobody waits for a last message."""

    def result(self) -> dict[str, Any]:
        return {}
