"""Every store key of the memberships, in one place: the rendezvous store is their side channel
(it works while a process group is stuck or gone), and no other module spells a key.

A leader's series of epochs lives under ``elastic/<leader>/<space>`` (:class:`Keys`); ``space``
tells apart several series the same leader leads (its members' groups, and the groups of the
leaders among themselves, say). A few keys belong to the whole job (:data:`RUNNING`,
:func:`moved`, the leave requests, :class:`ShardKeys`, :func:`subworld`).
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "elastic/"
# Set once every planned group exists: a process that starts as a rank of the job from then on
# replaces a lost one and joins (rlcomm.elastic.epochs.mark_running).
RUNNING = ROOT + "running"


@dataclass(frozen=True)
class Keys:
    """The keys of ``leader``'s series of epochs in ``space`` (``""``: its first series)."""

    leader: int
    space: str = ""

    @property
    def prefix(self) -> str:
        return f"{ROOT}{self.leader}/{self.space}"

    def key(self, name: str) -> str:
        """A key of this series the membership's users keep beside its own (their policy's
        records: e.g. what a lost member held)."""
        return self.prefix + name

    # ---- the epochs ---------------------------------------------------------------------

    def epoch(self, epoch: int) -> str:
        """The proposed members of ``epoch``, leader first (written before anyone forms it)."""
        return self.key(f"epoch/{epoch}")

    def final(self, epoch: int) -> str:
        """The members of ``epoch`` once settled: those that acknowledged it."""
        return self.key(f"final/{epoch}")

    def latest(self) -> str:
        """The newest epoch proposed."""
        return self.key("latest")

    def group(self, epoch: int) -> str:
        """The store prefix ``epoch``'s process group forms over."""
        return self.key(f"epoch{epoch}/")

    def ack(self, epoch: int, rank: int) -> str:
        """``rank`` acknowledged ``epoch``."""
        return self.key(f"ack/{epoch}/{rank}")

    def broken(self, epoch: int) -> str:
        """A member declared ``epoch``'s group broken: why."""
        return self.key(f"broken/{epoch}")

    # ---- joins ---------------------------------------------------------------------------

    def joins(self) -> str:
        """How many join requests were made (a counter)."""
        return self.key("joins")

    def join(self, n: int) -> str:
        """The ``n``-th join request: rank, host, pid."""
        return self.key(f"join/{n}")

    def admit(self, rank: int, pid: int) -> str:
        """The epoch that admits process ``pid`` as ``rank``."""
        return self.key(f"admit/{rank}/{pid}")

    def replaced(self, rank: int) -> str:
        """The pid of the newest process of ``rank`` (an older one that reads it stops)."""
        return self.key(f"replaced/{rank}")

    # ---- the end -------------------------------------------------------------------------

    def stopped(self) -> str:
        """What the leader left when it stopped (its users' counts, its live members)."""
        return self.key("final")

    def closed(self) -> str:
        """The members the series ended with, leader first."""
        return self.key("closed")

    # ---- liveness ------------------------------------------------------------------------

    def process(self, rank: int) -> str:
        """The pid of ``rank``'s process."""
        return self.key(f"process/{rank}")

    def beat(self, rank: int, pid: int) -> str:
        """Process ``pid`` of ``rank``'s heartbeat (a counter)."""
        return self.key(f"beat/{rank}/{pid}")

    def done(self, epoch: int, call: int, rank: int) -> str:
        """``rank`` completed call ``call`` over ``epoch``'s group (rlcomm.elastic.commit)."""
        return self.key(f"done/{epoch}/{call}/{rank}")


def grown() -> str:
    """How many ranks joined the job beyond its plan (a counter: the ``n``-th takes rank
    ``world_size + n - 1``)."""
    return f"{ROOT}grown"


def leave_requests() -> str:
    """How many leave requests were made in the job (a counter: every leader reads them all and
    takes those of its members)."""
    return f"{ROOT}leaves"


def leave_request(n: int) -> str:
    """The ``n``-th leave request: rank, reason."""
    return f"{ROOT}leave/{n}"


def let_go(rank: int) -> str:
    """The epoch from which ``rank``'s leader let it go at its request (the member then ends,
    where it would otherwise ask to join again)."""
    return f"{ROOT}let-go/{rank}"


def moved(rank: int) -> str:
    """The leader that took member ``rank`` over after its own was lost."""
    return f"{ROOT}adopt/{rank}"


@dataclass(frozen=True)
class ShardKeys:
    """The keys of groups that each carry one owner's shards to the members of every leader
    (generations of them, re-formed as the leaders' memberships change)."""

    root: str = ROOT + "shards/"

    def owners(self) -> str:
        return self.root + "owners"

    def indices(self, owner: int) -> str:
        return f"{self.root}indices/{owner}"

    def generation(self, generation: int) -> str:
        return f"{self.root}gen/{generation}"

    def leader_generation(self, leader: int, epoch: int) -> str:
        """The generation ``leader``'s ``epoch`` goes with."""
        return f"{ROOT}{leader}/gen/{epoch}"


def subworld(first: int) -> tuple[str, str]:
    """A block of ranks re-formed as a world of its own (its first rank ``first``): the counter
    of its processes' arrivals, and the prefix under which each re-forming's store lives."""
    return f"{ROOT}replicas/{first}/arrivals", f"{ROOT}replicas/{first}/"
