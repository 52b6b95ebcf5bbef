"""One membership for every group whose members come and go while a job runs: a *leader* and
its *members*, in *epochs*.

Each membership is an epoch: the planned group is epoch 0; every later one is a new gloo group
among the leader and the live members, formed over a store prefix of its own, as torchft
reconfigures its groups, with public torch APIs only. The rendezvous store is the side channel:
every key is :mod:`rlcomm.elastic.keys`'. The parts:

- :mod:`~rlcomm.elastic.epochs`: an epoch's group (:func:`build_epoch_group`) and the store
  records of every change (:class:`EpochRecords`, :func:`request_join`, :func:`ask_to_leave`,
  :func:`acknowledge`);
- :class:`Leader` and :class:`Member` (``leader.py``, ``member.py``): the two sides, built on
  them: propose, settle and form an epoch; follow, join, move to another leader;
- :class:`~rlcomm.elastic.groups.EpochGroups`: the epoch group of a mode in the context
  (``CommContext.epochs``);
- :mod:`~rlcomm.elastic.liveness`: heartbeats and processes, to tell a lost member from a slow
  one; :mod:`~rlcomm.elastic.commit`: a call over a group completed on every member or none;
- :mod:`~rlcomm.elastic.transport`: point to point inside an epoch, and what a lost member
  leaves behind (:data:`graveyard`);
- :class:`~rlcomm.elastic.changes.Changes`: every join and leave, for the records.

It knows members, leaders and groups; what a change means to the job (who takes a lost member's
work, what a joiner heals from) is its users' policy. docs/library.md shows it on its own.
"""

from rlcomm.elastic.changes import Change, Changes
from rlcomm.elastic.commit import CallCommit
from rlcomm.elastic.epochs import (
    BEYOND_PLAN,
    EpochRecords,
    Join,
    acknowledge,
    ask_to_leave,
    await_admission,
    build_epoch_group,
    close_membership,
    closing_members,
    epoch_members,
    is_running,
    latest_epoch,
    let_go_epoch,
    mark_running,
    new_rank,
    new_ranks,
    request_join,
    was_let_go,
)
from rlcomm.elastic.groups import EpochGroups
from rlcomm.elastic.keys import Keys, ShardKeys, moved, subworld
from rlcomm.elastic.leader import Leader
from rlcomm.elastic.liveness import BEAT_LOST_S, BEAT_S, Liveness, process_ended
from rlcomm.elastic.member import Member
from rlcomm.elastic.transport import (
    SEGMENT_TAG,
    drain,
    graveyard,
    patience_s,
    receive_from_members,
    send_to_leader,
)
from rlcomm.errors import MembershipError

__all__ = [
    "BEAT_LOST_S", "BEAT_S", "BEYOND_PLAN", "SEGMENT_TAG", "CallCommit", "Change", "Changes",
    "EpochGroups", "EpochRecords", "Join", "Keys", "Leader", "Liveness", "Member",
    "MembershipError", "ShardKeys", "acknowledge", "ask_to_leave", "await_admission",
    "build_epoch_group", "close_membership", "closing_members", "drain", "epoch_members",
    "graveyard", "is_running", "latest_epoch", "let_go_epoch", "mark_running", "moved", "new_rank", "new_ranks",
    "patience_s", "process_ended", "receive_from_members", "request_join", "send_to_leader",
    "subworld", "was_let_go",
]
