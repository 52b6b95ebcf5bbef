"""A trainer's replay: transitions from its segments, sampled for an off-policy update.

Pure torch (no ``torch.distributed``): each trainer holds one shard (a shard per trainer, as
segments are routed today), fills it from the segments it receives and samples batches from it.

- **Transitions** are made at insert time from a segment's time-major [T, N] layout, with the
  n-step return (``n_step``) summed inside the segment: step t of env i keeps
  ``sum_k gamma^k r[t+k]`` over the k < n steps that stay in its episode and in the segment, the
  observation those steps lead to, and the discount ``gamma^k`` to bootstrap from it (0 where
  the episode terminated inside the window). An episode cut by a time limit bootstraps from
  its true last observation (the segment's ``final_obs``). Near a segment's end the window is
  shorter: the last step bootstraps one step from the segment's ``next_obs``.
- **Capacity** is fixed; the oldest transitions are overwritten first (FIFO).
- **Sampling** is uniform, or proportional to ``priority ** priority_exponent`` (PER, Schaul et
  al. 2016; Ape-X, Horgan et al. 2018), with importance weights
  ``(size * P(i)) ** -importance_exponent`` divided by their maximum over the whole shard, so
  they only scale updates down. A new transition gets the largest priority seen so far.
- :class:`RateLimiter` keeps the learner's samples near ``samples_per_insert`` per inserted
  transition (Reverb's ``SampleToInsertRatio``), counted in whole learner steps: a pure rule on
  the counts it is given, applied beside a trainer's own shard (app/runtime/replay/client.py's
  ``LocalReplay``) or by a replay rank on its own (app/runtime/replay/service.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from app.runtime.core.data import Record, Segment
from app.runtime.core.replay_api import Batch, ReplaySettings

# Added to |TD error| so that no transition's probability falls to zero (PER's epsilon).
PRIORITY_FLOOR = 1e-6
# The segment fields a transition is made of; everything else it records is an extra.
_CORE = ("obs", "actions", "rewards", "dones", "next_obs", "next_done", "final_obs",
         "truncated")


def n_step_transitions(segment: Mapping[str, Tensor], n: int,
                       gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """Each step's n-step reward sum, discount and next observation, [T, N] (and [T, N, *obs]).

    ``dones[t]`` flags that ``obs[t]`` starts an episode, so step t ended one iff
    ``dones[t + 1]`` (``next_done`` for the last step); rewards after an end belong to the next
    episode and are not summed. A terminated episode does not bootstrap (discount 0). An
    episode cut by a time limit at step ``t + k`` (``truncated``, with its true last
    observation in ``final_obs``: the segment's ``obs[t + k + 1]`` is already the reset one)
    bootstraps from that observation with ``gamma ** (k + 1)``.
    """
    obs, rewards = segment["obs"], segment["rewards"].float()
    steps = rewards.shape[0]
    ended = torch.cat([segment["dones"][1:], segment["next_done"][None]]).float()
    truncated = segment["truncated"].float() if "truncated" in segment else None
    later = torch.cat([obs[1:], segment["next_obs"][None]])  # the observation after each step
    total = torch.zeros_like(rewards)
    alive = torch.ones_like(rewards)  # 1 while the window has not left its episode
    span = torch.zeros(steps, dtype=torch.long)  # steps summed per t (same for every env)
    cut = torch.full(rewards.shape, -1, dtype=torch.long)  # the step a time limit cut, if any
    for k in range(n):
        stop = steps - k  # steps t with t + k inside the segment
        if stop <= 0:
            break
        total[:stop] += (gamma ** k) * alive[:stop] * rewards[k:]
        if truncated is not None:
            newly = (alive[:stop] * truncated[k:]) > 0
            cut[:stop] = torch.where(newly, k, cut[:stop])
        alive[:stop] = alive[:stop] * (1.0 - ended[k:])
        span[:stop] += 1
    discounts = (gamma ** span.float())[:, None] * alive
    next_obs = later[span - 1 + torch.arange(steps)]
    if truncated is not None and bool((cut >= 0).any()):
        t, i = torch.nonzero(cut >= 0, as_tuple=True)
        discounts[t, i] = torch.pow(gamma, (cut[t, i] + 1).float())
        next_obs[t, i] = segment["final_obs"][t + cut[t, i], i].to(next_obs.dtype)
    return total, discounts, next_obs


class Replay:
    """One replay shard (a trainer's, or a replay rank's): fixed capacity, FIFO, uniform or
    proportional sampling.

    ``inserts`` and ``samples`` count transitions over the run (a checkpoint keeps them);
    ``size`` is how many the shard holds now, in slots ``[0, size)``; ``next_slot`` is where
    the next transition goes (the oldest is overwritten once the shard is full). A replay
    checkpoint (``loop.replay.checkpoint``) keeps the held transitions too: :meth:`contents`,
    :meth:`restore`.
    """

    def __init__(self, settings: ReplaySettings, fields: Mapping[str, Record],
                 gamma: float) -> None:
        self.settings, self.fields, self.gamma = settings, dict(fields), gamma
        self.storage: dict[str, Tensor] = {}  # allocated at the first insert, from its shapes
        self.priorities = torch.zeros(settings.capacity, dtype=torch.float64)  # p ** alpha
        self.max_priority = 1.0
        self.size = 0
        self.next_slot = 0
        self.inserts = 0
        self.samples = 0

    def insert(self, segment: Segment) -> int:
        """The segment's T x N transitions (n-step returns made here); returns how many."""
        rewards, discounts, later = n_step_transitions(segment, self.settings.n_step, self.gamma)
        columns = {
            "obs": segment["obs"], "actions": segment["actions"], "rewards": rewards,
            "next_obs": later, "discounts": discounts,
            **{name: segment[name] for name in self.fields},
        }
        count = rewards.numel()
        flat = {k: v.reshape(count, *v.shape[2:]) for k, v in columns.items()}
        capacity = self.settings.capacity
        if count > capacity:  # only the newest fit
            flat = {k: v[-capacity:] for k, v in flat.items()}
        kept = min(count, capacity)
        if not self.storage:
            self.storage = {k: torch.zeros(capacity, *v.shape[1:], dtype=v.dtype)
                            for k, v in flat.items()}
        # Slots from next_slot on, not from the insert count: a resumed shard's count is the
        # run's, while it fills slots [0, size) afresh (sampling draws from those).
        slots = (self.next_slot + count - kept + torch.arange(kept)) % capacity
        for name, values in flat.items():
            self.storage[name][slots] = values
        self.priorities[slots] = self.max_priority ** self.settings.priority_exponent
        self.inserts += count
        self.next_slot = (self.next_slot + count) % capacity
        self.size = min(self.size + count, capacity)
        return count

    def sample(self, generator: torch.Generator) -> Batch:
        """``batch_size`` transitions, drawn with replacement."""
        size, batch = self.size, self.settings.batch_size
        if size == 0:
            raise RuntimeError("replay: sampling from an empty shard")
        if self.settings.prioritized:
            indices, weights = self._prioritized(size, batch, generator)
        else:
            indices = torch.randint(size, (batch,), generator=generator)
            weights = torch.ones(batch)
        self.samples += batch
        rows = {name: values[indices] for name, values in self.storage.items()}
        return Batch(obs=rows.pop("obs"), actions=rows.pop("actions"),
                     rewards=rows.pop("rewards"), next_obs=rows.pop("next_obs"),
                     discounts=rows.pop("discounts"), weights=weights, indices=indices,
                     extras=rows)

    def _prioritized(self, size: int, batch: int,
                     generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Slots drawn in proportion to their stored ``p ** alpha`` (inverse CDF over the
        cumulative sum: linear in the shard per batch, vectorised), and their weights."""
        stored = self.priorities[:size]
        cumulative = torch.cumsum(stored, 0)
        total = cumulative[-1]
        draws = torch.rand(batch, generator=generator, dtype=torch.float64) * total
        indices = torch.searchsorted(cumulative, draws, right=True).clamp_(max=size - 1)
        beta = self.settings.importance_exponent
        weights = (size * stored[indices] / total) ** -beta
        largest = (size * stored.min() / total) ** -beta
        return indices, (weights / largest).float()

    def update_priorities(self, indices: Tensor, priorities: Tensor) -> None:
        """New priorities (e.g. |TD error|) for sampled slots."""
        raw = priorities.detach().abs().double() + PRIORITY_FLOOR
        self.priorities[indices] = raw ** self.settings.priority_exponent
        self.max_priority = max(self.max_priority, float(raw.max()))

    def priority_spread(self) -> float:
        """How unequal the sampling probabilities are: the coefficient of variation (std /
        mean) of the held ``p ** alpha``; 0 when uniform."""
        if not self.settings.prioritized or self.size < 2:
            return 0.0
        held = self.priorities[: self.size]
        return float(held.std() / held.mean())

    def state_dict(self) -> dict[str, Any]:
        """The counters (a resume refills the shard: docs/off-policy.md)."""
        return {"inserts": self.inserts, "samples": self.samples,
                "max_priority": self.max_priority}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inserts, self.samples = int(state["inserts"]), int(state["samples"])
        self.max_priority = float(state["max_priority"])

    def contents(self) -> dict[str, Any]:
        """The transitions held, oldest first, and their stored priorities: copies, which a
        replay checkpoint writes while the shard goes on changing."""
        capacity = self.settings.capacity
        start = self.next_slot if self.size == capacity else 0
        order = (start + torch.arange(self.size)) % capacity
        return {"transitions": {name: values[order] for name, values in self.storage.items()},
                "priorities": self.priorities[order], "max_priority": self.max_priority}

    def restore(self, held: Sequence[Mapping[str, Any]]) -> None:
        """Transitions :meth:`contents` gave (one shard's, or several shards' dealt to this
        one), oldest first, into this shard; the newest ``capacity`` are kept. The counters are
        the checkpoint's own (:meth:`load_state_dict`)."""
        held = [h for h in held if h["priorities"].numel()]
        if not held:
            return
        capacity = self.settings.capacity
        names = list(held[0]["transitions"])
        joined = {n: torch.cat([h["transitions"][n] for h in held])[-capacity:] for n in names}
        priorities = torch.cat([h["priorities"] for h in held])[-capacity:]
        kept = int(priorities.numel())
        if not self.storage:
            self.storage = {n: torch.zeros(capacity, *v.shape[1:], dtype=v.dtype)
                            for n, v in joined.items()}
        for name, values in joined.items():
            self.storage[name][:kept] = values
        self.priorities[:kept] = priorities
        self.size, self.next_slot = kept, kept % capacity
        self.max_priority = max(float(h["max_priority"]) for h in held)


class RateLimiter:
    """Samples per insert, in whole learner steps (Reverb's ``SampleToInsertRatio``): a rule on
    the counts its callers pass, with no state of its own beyond its settings.

    Once ``min_size`` transitions are held, the learner's samples track
    ``target = samples_per_insert * (inserts - min_size)``: a learner step (``batch_size``
    samples) is allowed while it keeps samples within ``target + tolerance``, and collectors
    may insert while samples stay within ``tolerance`` below the target. ``tolerance >=
    (batch_size + samples_per_insert) / 2`` (checked before launch) means one side is always
    allowed. ``inserts`` and ``samples`` count from when this limiter's shard started filling
    (a resumed run's refill included).
    """

    def __init__(self, samples_per_insert: float, tolerance: float, min_size: int,
                 batch_size: int) -> None:
        self.samples_per_insert, self.tolerance = samples_per_insert, tolerance
        self.min_size, self.batch_size = min_size, batch_size

    def target(self, inserts: int) -> float:
        return self.samples_per_insert * (inserts - self.min_size)

    def steps_allowed(self, inserts: int, samples: int, size: int) -> int:
        """Learner steps allowed now."""
        if size < self.min_size or size == 0:
            return 0
        room = self.target(inserts) + self.tolerance - samples
        return max(0, math.floor(room / self.batch_size))

    def inserts_allowed(self, inserts: int, samples: int) -> int:
        """Transitions collectors may insert now before the learner must catch up."""
        if inserts < self.min_size:
            return self.min_size - inserts + self._inserts_past(self.min_size, samples)
        return self._inserts_past(inserts, samples)

    def steps_to_admit(self, inserts: int, samples: int, count: int, most: int) -> int:
        """The fewest learner steps (at most ``most``) after which collectors may insert
        ``count`` more transitions: until the learner has taken them, collectors are blocked."""
        steps = 0
        while steps < most and self.inserts_allowed(inserts,
                                                    samples + steps * self.batch_size) < count:
            steps += 1
        return steps

    def _inserts_past(self, inserts: int, samples: int) -> int:
        room = samples + self.tolerance - self.target(inserts)
        return max(0, math.floor(room / self.samples_per_insert))
