"""The weight channel: how a version of the weights goes from the trainers to whoever acts.

Every channel is built on rlcomm.weights' sender and receiver, so checksums
(``loop.verify_weights_every``), versions and ``loop.max_staleness`` behave alike. This module
has the protocol, the flat channel (a trainer's whole weights, zero-copy from the bound agent,
over WEIGHT_TRANSFER) and the channel of ranks that neither send nor take weights; the sharded
one (each shard owner's slices) is app/runtime/handoff/weights_sharded.py.

A channel follows its group's membership (app/runtime/membership/base.py): ``begin`` opens
it on the first group, ``end`` closes it (``moved``: to a new epoch), ``renew`` reopens it on
the next epoch's group with a first version verified whatever ``verify_every`` says. On a
static layout only ``begin`` is ever called.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from app.runtime.handoff.base import HandOffSettings, HandOffStats
from app.runtime.membership.base import Unchanging
from rlcomm import CommContext, ParallelMode
from rlcomm.elastic import graveyard
from rlcomm.weights import WeightReceiver, WeightSender, WeightTransferError

WT = ParallelMode.WEIGHT_TRANSFER


class WeightChannel(Protocol):
    """One rank's end of the weights' way: the sending end (trainers) or the taking end."""

    weight_bytes: int  # what one version costs to send to one receiver

    @property
    def sends(self) -> bool | None:
        """The sending end (its time is transfer time), the taking end (its time is
        waiting), or None where nothing moves."""
        ...

    def version_after(self, updates: int) -> int:
        """The version last sent (sending end) or acted with (taking end), ``updates`` done."""
        ...

    def begin(self, members: list[int]) -> None:
        """The first group formed (``members``: who takes the weights)."""
        ...

    def sync(self, first: bool) -> None:
        """Sends the next version, or takes the newest ``max_staleness`` allows. The first
        (it carries the layout) is complete on both sides when this returns."""
        ...

    def settle(self) -> None:
        """The last send is out of the send buffers (the optimizer is about to rewrite them)."""
        ...

    def agree(self, changing: bool) -> bool:
        """Whether a membership change is to happen, where the channel's groups span more than
        one leader's members (every leader must form the new epoch with it)."""
        ...

    def end(self, moved: bool, epoch: int) -> None:
        """No more versions on this group (``moved``: the members go to ``epoch``)."""
        ...

    def renew(self, epoch: int, members: list[int]) -> None:
        """The group of ``epoch`` formed: its first version, verified."""
        ...


class NoWeights(Unchanging):
    """The channel of a rank no weights go to or from (colocated, a replay rank).
    ``counts_updates``: its version is the number of updates done (else 0)."""

    sends = None
    weight_bytes = 0

    def __init__(self, counts_updates: bool) -> None:
        self.counts_updates = counts_updates

    def version_after(self, updates: int) -> int:
        return updates if self.counts_updates else 0

    def sync(self, first: bool) -> None:
        """Nothing moves."""

    def settle(self) -> None:
        """Nothing in flight."""


def policy_receiver(ctx: CommContext, policy: nn.Module) -> WeightReceiver:
    """The acting side of WEIGHT_TRANSFER: it accepts exactly ``policy``'s names, shapes and
    dtypes (anything else is an error naming the tensor, on both sides, before data moves)."""
    return WeightReceiver(ctx, WT, expected=policy.state_dict())


class FlatSender:
    """A trainer's whole weights over WEIGHT_TRANSFER, sent from the bound agent (zero-copy:
    the parameters live in the send buffer, and DDP and the optimizer hold the same Parameter
    objects as ever). ``elastic``: a member lost while weights were in flight is dropped later,
    by the membership, not raised here."""

    sends = True

    def __init__(self, ctx: CommContext, agent: nn.Module, settings: HandOffSettings,
                 stats: HandOffStats, elastic: bool) -> None:
        self.ctx, self.agent, self.stats, self.elastic = ctx, agent, stats, elastic
        self.verify_every = settings.verify_every
        self.weight_bytes = sum(t.nbytes for t in agent.state_dict().values())
        self.sender: WeightSender | None = None

    @property
    def version(self) -> int:
        return self.sender.version if self.sender is not None else 0

    def version_after(self, updates: int) -> int:
        return self.version

    def _sender(self, first_version: int) -> WeightSender:
        sender = WeightSender(self.ctx, WT, verify_every=self.verify_every,
                              first_version=first_version)
        sender.bind(self.agent)
        return sender

    def begin(self, members: list[int]) -> None:
        """The group is built: the sender, bound before anything wraps the agent."""
        self.sender = self._sender(first_version=0)

    def sync(self, first: bool) -> None:
        # Later sends are launched without waiting: settle() waits before the next optimizer
        # step; every member issues the same operations in the same order.
        assert self.sender is not None
        self.sender.send(self.agent, wait=first)  # bound: no state dict, no copy
        self._count()

    def _count(self) -> None:
        receivers = len(self.ctx.get_ranks_in_group(WT)) - 1
        self.stats.weight_bytes_sent += receivers * self.weight_bytes

    def settle(self) -> None:
        assert self.sender is not None
        if not self.elastic:
            self.sender.wait()
            return
        try:
            self.sender.wait()
        except Exception:  # a member lost while its weights were in flight: dropped next
            graveyard.append(self.sender.abandon())

    def agree(self, changing: bool) -> bool:
        return changing  # this trainer's group is its own

    def end(self, moved: bool, epoch: int) -> None:
        assert self.sender is not None
        graveyard.append((self.sender, self.ctx.get_group(WT), self.sender.end(moved=moved)))

    def renew(self, epoch: int, members: list[int]) -> None:
        """Every member, a joiner above all, starts from these weights."""
        self.sender = self._sender(first_version=self.version)
        self.sender.send(self.agent, wait=True, verify=True)
        self._count()


class FlatReceiver:
    """The whole weights from one trainer, into the bound agent (loads point the policy at the
    received bytes). ``elastic``: the trainer's last message (stop, or moved to a new epoch)
    carries no version, so in lockstep a version is received beside the acting weights."""

    sends = False
    weight_bytes = 0

    def __init__(self, ctx: CommContext, agent: nn.Module, settings: HandOffSettings,
                 elastic: bool) -> None:
        self.ctx, self.agent, self.elastic = ctx, agent, elastic
        self.max_staleness = settings.max_staleness
        self.version = 0
        self.receiver: WeightReceiver | None = None

    def version_after(self, updates: int) -> int:
        return self.version

    def begin(self, members: list[int]) -> None:
        """The group is built: the receiver, bound to the agent (zero-copy loads)."""
        self.receiver = policy_receiver(self.ctx, self.agent)
        self.receiver.bind(self.agent)

    def sync(self, first: bool) -> None:
        assert self.receiver is not None
        if not self.elastic:
            self.version = receive_weights([(self.receiver, self.agent)], first,
                                           self.max_staleness)
        elif first:
            if self.version == 0:  # else a joiner took its first weights when it entered
                self.version = self.receiver.receive_into(self.agent)
        elif self.max_staleness == 0:
            self.receiver.receive()
            self.version = self.receiver.load(self.agent)
        else:
            self.version = receive_weights([(self.receiver, self.agent)], False,
                                           self.max_staleness)

    def settle(self) -> None:
        """Nothing is sent from here."""

    def agree(self, changing: bool) -> bool:
        return changing

    def end(self, moved: bool, epoch: int) -> None:
        """Keeps what was posted alive: no more versions come on this group."""
        assert self.receiver is not None
        graveyard.append((self.receiver, self.ctx.get_group(WT), self.receiver.abandon()))

    def renew(self, epoch: int, members: list[int]) -> None:
        """The epoch's first weights: complete before acting, verified by their checksums."""
        self.begin(members)
        assert self.receiver is not None
        self.version = self.receiver.receive_into(self.agent)


def receive_weights(receivers: list[tuple[WeightReceiver, nn.Module]], first: bool,
                    max_staleness: int) -> int:
    """An acting rank takes its next weights from one receiver or several (a sharded channel's,
    one per shard owner, each into its own module), all of one version; returns it.

    The first transfer and every one in lockstep (``max_staleness=0``) lands in the bytes the
    policy acts with: it is idle until they arrive (no second buffer, nothing to swap); from
    several senders, their transfers run side by side. Else the next version is posted (from
    several senders at once) and the newest arrived version swapped in, waiting only for what
    ``max_staleness`` requires.
    """
    if first or (max_staleness == 0 and len(receivers) == 1):
        versions = [receiver.receive_into(module) for receiver, module in receivers]
    elif max_staleness == 0:  # several senders in lockstep: in place, side by side
        for receiver, _ in receivers:
            receiver.post(in_place=True)
        for receiver, _ in receivers:
            receiver.receive()  # completes the posted receive
        versions = [receiver.load(module) for receiver, module in receivers]
    else:
        versions = _newest(receivers, max_staleness)
    if len(set(versions)) > 1:
        raise WeightTransferError(f"the shard owners sent different weights versions {versions}")
    return versions[0]


def _newest(receivers: list[tuple[WeightReceiver, nn.Module]], max_staleness: int) -> list[int]:
    """Posts the next version from every sender (their transfers run side by side) and swaps
    in the newest that has arrived from all, as stale as ``max_staleness`` allows at most."""
    for receiver, _ in receivers:
        receiver.post()
    for receiver, _ in receivers:
        # The trainer will train the next segment with the version just posted.
        newest = receiver.version + receiver.posted
        while receiver.version < newest - max_staleness:
            receiver.receive()  # completes the oldest posted receive
    # A segment boundary: swap in the newest version that has arrived, the same from every
    # sender (one may have delivered more than another: the others catch up).
    versions = [receiver.load(module) for receiver, module in receivers]
    while len(set(versions)) > 1:
        top = max(versions)
        for receiver, _ in receivers:
            while receiver.version < top:
                receiver.receive()
        versions = [receiver.load(module) for receiver, module in receivers]
    return versions

