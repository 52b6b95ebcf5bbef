"""What an algorithm plugs into the runtime, and nothing else: four things.

1. its **settings**: a dataclass deriving from :class:`AlgorithmSettings` (the rollout shape
   and discount every algorithm has), with ``range_errors`` for its own range checks;
2. the **acting module**, built from the spaces (:meth:`Algorithm.build`);
3. **what a step records** besides observation, action, reward and done
   (:attr:`Algorithm.records`, filled by :meth:`Algorithm.act`);
4. the **update** (:meth:`Algorithm.update`), run on each trainer with the DDP-wrapped model
   and the segments the runtime gathered for it.

The deterministic action (:meth:`Algorithm.greedy`, for evaluation and export) defaults to
the module's own ``greedy(obs)``. An algorithm that learns from a replay (an off-policy one,
app/runtime/replay/offpolicy.py) also declares its ``loop.replay``
(:meth:`Algorithm.replay_settings`) and takes the replay the runtime hands it where the replay
lives on replay ranks (:meth:`Algorithm.learn_from`); an algorithm without one keeps both
defaults.

The runtime (``app/runtime/``) owns the rest: roles, environments, collection, moving segments,
weight sync, normalisation, the stop rule, checkpoints and every record of the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch
from torch import Tensor, nn

from app.api import setting
from app.runtime.core.data import Record, Segment, Spaces
from app.runtime.core.replay_api import ReplayClient, ReplaySettings

__all__ = ["Algorithm", "AlgorithmSettings", "Record", "Segment", "Spaces", "UpdateInfo"]


@dataclass
class UpdateInfo:
    """What the runtime hands an update besides the model and the segments."""

    optimizer: torch.optim.Optimizer
    generator: torch.Generator  # seeded per (seed, rank, update): a resume shuffles alike
    env_steps: int  # env steps collected so far, all collectors together (for annealing)
    update: int  # updates done before this one
    lag: int  # the oldest segment's version lag (0 in lockstep)
    peers: Peers = field(default_factory=lambda: Peers())  # the trainers it is made with


class Peers:
    """The trainers an update is made with: one here; the runtime's
    (app/runtime/trainer/role.py) are the live trainers, which elastic trainers re-form.
    Gradients through ``model`` are averaged over them already; what an algorithm steps outside
    it, or must agree on, goes through these."""

    def size(self) -> int:
        return 1

    def fewest(self, count: int) -> int:
        """The smallest ``count`` among the trainers (e.g. the learner steps every one takes)."""
        return count

    def average(self, tensor: Tensor) -> None:
        """``tensor`` averaged over the trainers, in place (e.g. a gradient stepped outside
        ``model``)."""


@dataclass
class AlgorithmSettings:
    """The settings every algorithm has: the rollout's shape and the discount."""

    num_envs: int = setting(16, "environments per collecting rank (one vector env)")
    num_steps: int = setting(64, "steps per environment per update (rollout length)")
    gamma: float = setting(0.99, "discount factor, in (0, 1]")

    def range_errors(self, batch_per_trainer: int) -> list[str]:
        """Out-of-range settings as ``field: must be ..., got value`` (empty when all fit);
        subclasses extend the list. ``batch_per_trainer``: env steps each trainer gets."""
        checks = [
            ("num_envs", self.num_envs >= 1, "a positive integer"),
            ("num_steps", self.num_steps >= 1, "a positive integer"),
            ("gamma", 0 < self.gamma <= 1, "in (0, 1]"),
        ]
        return [f"{name}: must be {want}, got {getattr(self, name)}"
                for name, ok, want in checks if not ok]


S = TypeVar("S", bound=AlgorithmSettings)


def adam(params: Iterable[Any], **kwargs: Any) -> torch.optim.Adam:
    """``torch.optim.Adam(params, **kwargs)``, PyTorch's fused one where every parameter is a
    plain tensor: one kernel per step instead of a loop over parameters, the same update to
    rounding (16-18% off PPO's and DQN's learner steps, docs/off-policy.md, "Learner speed").
    Sharded parameters (DTensors) keep the default."""
    params = list(params)
    tensors = [t for group in params
               for t in (group["params"] if isinstance(group, dict) else [group])]
    fused = all(type(t) in (torch.Tensor, nn.Parameter) for t in tensors)
    return torch.optim.Adam(params, fused=fused or None, **kwargs)


class Algorithm(Generic[S]):
    """An RL algorithm on the runtime. Subclass it, set :attr:`records` and :attr:`losses`,
    and implement :meth:`build`, :meth:`act` and :meth:`update`."""

    #: Per-step fields :meth:`act` returns besides the action, by name.
    records: ClassVar[Mapping[str, Record]] = {}
    #: The figures :meth:`update` returns (the columns of ``metrics.csv`` after the runtime's).
    losses: ClassVar[tuple[str, ...]] = ()
    #: True: segments carry ``truncated`` and ``final_obs`` (see :class:`Segment`) and the
    #: worker adds no :meth:`value` bootstrap to the reward: the update bootstraps a time-limit
    #: cut itself, with the weights it learns with (an off-policy algorithm's replay does).
    final_observations: ClassVar[bool] = False
    #: ``loop.compile`` (app/runtime/core/compiling.py), which the loop sets on the algorithm it
    #: builds: how an update that supports it compiles its step ("off": as written).
    compile_mode: str = "off"
    #: True: the update compiles its step as :attr:`compile_mode` says (else loop.compile other
    #: than "off" is refused before launch).
    compiles: ClassVar[bool] = False

    def __init__(self, settings: S, spaces: Spaces) -> None:
        self.settings = settings
        self.spaces = spaces

    @classmethod
    def space_problem(cls, spaces: Spaces) -> str | None:
        """Why this algorithm cannot handle ``spaces`` (checked before launch), or None."""
        return None

    def build(self) -> nn.Module:
        """The acting module for :attr:`spaces`; every rank builds it after seeding torch alike,
        so its initial weights agree."""
        raise NotImplementedError

    def act(
        self, module: nn.Module, obs: Tensor, generator: torch.Generator
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """One vector step: the actions for ``obs`` [N, *obs] and each of :attr:`records`
        ([N, *shape]). Runs under ``torch.no_grad``; sample with ``generator``."""
        raise NotImplementedError

    def greedy(self, module: nn.Module, obs: Tensor) -> Tensor:
        """The deterministic action for ``obs`` [N, *obs] (a Gaussian's mean, a categorical's
        argmax), for evaluation and export; runs under ``torch.no_grad``. By default the
        module's own ``greedy(obs)``, which the shipped policies define."""
        greedy = getattr(module, "greedy", None)
        if not callable(greedy):
            raise NotImplementedError(
                f"{type(self).__name__}.greedy: {type(module).__name__} has no greedy(obs); "
                "override Algorithm.greedy")
        return cast(Tensor, greedy(obs))

    def set_collector(self, index: int, count: int) -> None:
        """On a collecting rank, before it collects: it is collector ``index`` (0-based, in
        rank order; a rank that rejoins keeps its index) of the run's ``count``, for exploration
        that differs per collector (Ape-X's epsilons). Nothing by default."""

    def value(self, module: nn.Module, obs: Tensor) -> Tensor | None:
        """State values [N] to bootstrap episodes cut by a time limit (``gamma * V(final obs)``
        is added to that step's reward), or None for no bootstrap."""
        return None

    def replay_settings(self) -> ReplaySettings | None:
        """``loop.replay`` for an algorithm that learns from a replay; None (the default) for
        one that does not."""
        return None

    def learn_from(self, replay: ReplayClient) -> None:
        """On a trainer, before its first update and before a resume's
        :meth:`load_state_dict`: learn from ``replay`` (the replay ranks' client,
        ``layout.replay``) rather than from a replay of this trainer's own. An algorithm
        without a replay (the default) cannot: the check before launch refuses replay ranks
        for its loop."""
        raise TypeError(f"{type(self).__name__} does not learn from a replay")

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this algorithm besides the module and the optimizer
        (target networks live in the module; an off-policy algorithm's replay counters here).
        Empty by default: the checkpoint then holds no ``algorithm`` entry."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run's :meth:`state_dict`, on every trainer before its first update."""

    def optimizer(self, module: nn.Module) -> torch.optim.Optimizer:
        """The trainer's optimizer (checkpointed by the runtime): Adam at ``settings.lr``."""
        return torch.optim.Adam(module.parameters(), lr=self.settings.lr, eps=1e-5)  # type: ignore[attr-defined]

    def update(
        self, model: nn.Module, module: nn.Module, segments: list[Segment], info: UpdateInfo
    ) -> dict[str, float]:
        """Train on ``segments``: losses through ``model`` (``module`` wrapped by DDP, so the
        gradients are averaged over the trainers; on a sharded trainer, docs/sharding.md, a
        copy of it split over the trainer grid, whose parameters are DTensors), anything
        without gradients through ``module`` (on a sharded trainer: the whole weights as this
        update started). Returns the figures named in :attr:`losses`."""
        raise NotImplementedError
