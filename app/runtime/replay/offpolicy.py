"""Off-policy algorithms on the runtime: a replay behind the one update call.

An :class:`OffPolicyAlgorithm` declares what a transition records (the ``records`` every
algorithm has), how it explores (``act``) and acts greedily (``greedy``), and one gradient step
on a sampled batch (:meth:`OffPolicyAlgorithm.learn`), which may return new priorities. Its
update, written once here, sees its replay only through a replay client
(app/runtime/replay/client.py: this trainer's own shard, or the replay ranks' client the
runtime hands over with :meth:`OffPolicyAlgorithm.learn_from`): it inserts the segments the
runtime hands the trainer, asks how many learner steps the rate limiter allows, agrees on the
fewest over the trainers (every DDP rank must run as many backward passes), and samples,
learns and feeds priorities back that many times. The runtime, PPO and V-trace are untouched:
to them this is one more update.

The limiter holds both sides, and the update measures how long each waited on it: the
collectors' next segment is admitted only once the learner has taken the steps the ratio asks
for first (``collector_wait_s``: the seconds of those steps), and the learner, once it has
taken every step the ratio allows, waits for the next inserts (``learner_wait_s``: the seconds
from then to the next update). A resumed run refills its replay: the checkpoint keeps the
replay's counters, not its contents (docs/off-policy.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from app.runtime.core.algorithm import Algorithm, S, Segment, Spaces, UpdateInfo
from app.runtime.replay.buffer import Batch, ReplaySettings
from app.runtime.replay.client import LocalReplay, ReplayClient

if TYPE_CHECKING:
    pass

# The replay's figures every off-policy update returns (metrics.csv columns, averaged over the
# trainers' shards): what the shard holds, what went in and out, the ratio held since sampling
# began, how unequal the priorities are, the learner steps this update, whether the limiter
# held the learner back for the whole update, the seconds of the update spent in the replay
# (inserting, sampling, writing priorities: the rest of the update is the learner's), and the
# seconds collectors and learner have waited on the limiter (this attempt's, so far).
REPLAY_FIGURES = ("replay_size", "replay_inserts", "replay_samples", "samples_per_insert",
                  "priority_spread", "learner_steps", "learner_wait", "replay_s",
                  "collector_wait_s", "learner_wait_s")


class OffPolicyAlgorithm(Algorithm[S]):
    """An algorithm that learns from a replay: implement :meth:`build`, :meth:`act`,
    :meth:`greedy` (or the module's own) and :meth:`learn`; :meth:`update` is this class's."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The replay's figures follow the algorithm's own in metrics.csv.
        cls.losses = tuple(cls.losses) + tuple(n for n in REPLAY_FIGURES if n not in cls.losses)

    #: The replay bootstraps a time-limit cut from the episode's true last observation with the
    #: learner's current networks, not with the collector's value at collection time.
    final_observations = True

    def __init__(self, settings: S, spaces: Spaces, replay: ReplaySettings | None = None) -> None:
        super().__init__(settings, spaces)
        self._replay_settings = replay if replay is not None else ReplaySettings()
        # The runtime's (learn_from), else this trainer's own shard, built at its first use.
        self._replay: ReplayClient | None = None
        self.learner_steps = 0  # over the run (checkpointed): e.g. for target-network periods
        # When the learner last ran out of allowed steps (None: it had steps left, or no update
        # yet): the time from then to the next update is its wait on the limiter.
        self._idle_since: float | None = None
        # Seconds each side waited on the limiter over this attempt (a resume starts at 0, as
        # the run's other times do).
        self.waited_s = {"collector_wait_s": 0.0, "learner_wait_s": 0.0}

    def replay_settings(self) -> ReplaySettings:
        """``loop.replay``, as the loop built this algorithm with it."""
        return self._replay_settings

    def learn_from(self, replay: ReplayClient) -> None:
        """Learn from ``replay`` instead of a shard of this trainer's own: the replay ranks'
        client (app/runtime/replay/service.py), handed over before the first update and
        before a resume's :meth:`load_state_dict`."""
        if self._replay is not None:
            raise RuntimeError(f"{type(self).__name__}.learn_from: the algorithm already "
                               "uses a replay; hand it over before its first use")
        self._replay = replay

    @property
    def replay(self) -> ReplayClient:
        """The replay this algorithm learns from: the runtime's (:meth:`learn_from`), or this
        trainer's own shard (app/runtime/replay/client.py's ``LocalReplay``)."""
        if self._replay is None:
            self._replay = LocalReplay(self._replay_settings, self.records, self.settings.gamma)
        return self._replay

    def learn(self, model: nn.Module, module: nn.Module, batch: Batch,
              info: UpdateInfo) -> tuple[dict[str, float], Tensor | None]:
        """One gradient step on ``batch`` through ``model`` (DDP-wrapped when there are several
        trainers: gradients averaged over them; one trainer gets ``module`` itself, since DDP
        over one rank averages nothing and its hooks weigh on a small network's step): the
        figures named in :attr:`losses` (the replay's aside) and new
        priorities [B] for the sampled transitions, or None."""
        raise NotImplementedError

    def update(self, model: nn.Module, module: nn.Module, segments: list[Segment],
               info: UpdateInfo) -> dict[str, float]:
        started = time.perf_counter()
        learner_wait_s = started - self._idle_since if self._idle_since is not None else 0.0
        replay = self.replay
        before = replay.inserts
        tick = time.perf_counter()
        for segment in segments:
            replay.insert(segment)
        in_replay = time.perf_counter() - tick
        peers = info.peers
        if isinstance(replay, LocalReplay):  # its share of min_size among the trainers'
            replay.share_among(peers.size())
        allowed = replay.steps_allowed()
        steps = peers.fewest(allowed)  # every trainer takes as many steps (each averages)
        # This round's transitions: inserted here, or written by the collectors to the replay
        # ranks (layout.replay), whose counts the allowance just refreshed. The next round
        # brings as many: the collectors wait until the learner has taken the steps that admit
        # them.
        arrived = replay.inserts - before
        blocking = replay.steps_to_admit(arrived, steps)
        learner = model if peers.size() > 1 else module
        figures: dict[str, float] = {}
        collector_wait_s, learning = 0.0, time.perf_counter()
        for step in range(steps):
            tick = time.perf_counter()
            batch = replay.sample(info.generator)
            in_replay += time.perf_counter() - tick
            learnt, priorities = self.learn(learner, module, batch, info)
            self.learner_steps += 1
            if priorities is not None and replay.settings.prioritized:
                tick = time.perf_counter()
                replay.update_priorities(batch.indices, priorities)
                in_replay += time.perf_counter() - tick
            for name, value in learnt.items():
                figures[name] = figures.get(name, 0.0) + value / steps
            if step + 1 == blocking:
                collector_wait_s = time.perf_counter() - learning
        own = {n: figures.get(n, float("nan")) for n in self.losses if n not in REPLAY_FIGURES}
        # Every allowed step taken (not held back by another trainer): the learner now waits.
        self._idle_since = time.perf_counter() if steps == allowed else None
        self.waited_s["collector_wait_s"] += collector_wait_s
        self.waited_s["learner_wait_s"] += learner_wait_s
        return {**own, **self.replay_figures(steps), "replay_s": in_replay}

    def replay_figures(self, steps: int) -> dict[str, float]:
        """The replay's figures after an update of ``steps`` learner steps."""
        return {**self.replay.figures(), "learner_steps": float(steps),
                "learner_wait": float(steps == 0), **self.waited_s}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this algorithm beyond the module and the optimizer: the
        replay's counters and the learner's step count (a subclass adds its own)."""
        return {"replay": self.replay.state_dict(), "learner_steps": self.learner_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's :meth:`state_dict`; the shard starts empty and refills to
        ``min_size`` before the learner steps again."""
        self.replay.load_state_dict(state["replay"])
        self.learner_steps = int(state["learner_steps"])


def transition_bytes(spaces: Spaces) -> int:
    """About what one transition takes in a replay shard: the observation twice (and the
    next one), the action, the reward, the discount and the priority."""
    import numpy as np

    def nbytes(space: Any) -> int:
        shape = space.shape or ()
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(space.dtype).itemsize

    return 2 * nbytes(spaces.observation) + max(nbytes(spaces.action), 8) + 4 + 4 + 8


def hard_update(target: nn.Module, source: nn.Module) -> None:
    """Copy ``source``'s parameters into ``target`` (a target network)."""
    with torch.no_grad():
        for t, s in zip(target.parameters(), source.parameters(), strict=True):
            t.copy_(s)


def soft_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """Polyak averaging: ``target <- tau * source + (1 - tau) * target``, one ``lerp_`` over
    all the parameters (the same update as a loop of them, with one call)."""
    targets: list[torch.Tensor] = list(target.parameters())
    sources: list[torch.Tensor] = list(source.parameters())
    if len(targets) != len(sources):
        raise ValueError(f"soft_update: {len(targets)} target parameters, {len(sources)} source")
    if targets:
        with torch.no_grad():
            torch._foreach_lerp_(targets, sources, tau)
