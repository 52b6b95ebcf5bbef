"""The runtime's settings (``loop.*``): their schema, each field with its one-line doc. Their
checks before any rank starts are app/runtime/validation.py's, what they build (the policy,
the checkpoint cadence, the stop rule, the summary) app/runtime/settings/builders.py's; one rank's run
(app/runtime/run.py) reads them; :class:`~app.runtime.loop.RLLoop` adds the loop's hooks and
the entry every rank calls.
"""

from __future__ import annotations

import pickle
import typing
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from app.api import LoopMetrics, setting
from app.runtime.checkpoints.cadence import DEFAULT_INTERVAL_S, DEFAULT_KEEP
from app.runtime.core.algorithm import Algorithm, AlgorithmSettings, Spaces
from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.models.actor_critic import ModelConfig


@dataclass
class RunSettings:
    """The RL runtime's settings (``loop.*``); a loop's subclass adds ``hparams`` (the
    algorithm's settings) and ``algorithm``."""

    # layout.replay: the runtime hands segments to trainers; only a replay's loop takes them.
    replay_ranks_supported: ClassVar[bool] = False
    total_env_steps: int = setting(400_000, "budget: stop here if the target is not reached")
    target_return: float | None = setting(
        None, "stop once the mean return of the last `window` episodes reaches it (null: the "
        "env's registered reward_threshold, e.g. 475 for CartPole-v1; an env without one: the "
        "budget alone)"
    )
    stop_at_target: bool = setting(
        True, "end the run when the target return is reached (false: note when it was "
        "reached, for time_to_target_s, and train on to the budget)"
    )
    window: int = setting(20, "episodes in the stop rule's mean return")
    checkpoint_every: int | None = setting(
        None, "updates between checkpoints (null: every checkpoint_every_s seconds of training "
        "instead; 0: no checkpoints at all, not even the last)"
    )
    checkpoint_every_s: float = setting(
        DEFAULT_INTERVAL_S, "seconds of training between checkpoints while checkpoint_every is "
        "null (0: only the last one and one when asked to stop, SIGTERM)"
    )
    checkpoint_keep: int = setting(
        DEFAULT_KEEP, "the newest checkpoints kept; older ones are removed once a newer one is "
        "durable (checkpoints/best and milestones apart)"
    )
    milestone_every: int = setting(
        0, "also keep the first checkpoint at or past every multiple of N updates, in "
        "checkpoints/milestones/ (0: none)"
    )
    milestone_every_s: float = setting(
        0.0, "also keep the first checkpoint at or past every multiple of N seconds of "
        "training, in checkpoints/milestones/ (0: none)"
    )
    resume: str | None = setting(None, "a checkpoint file, or a run dir holding checkpoints/ (its newest valid one)")
    progress: bool = setting(True, "rank 0's progress line: a bar on a terminal, plain lines otherwise")
    tensorboard: bool = setting(False, "TensorBoard scalars under <run dir>/tensorboard (the tensorboard extra); the same as trackers=[tensorboard]")
    trackers: list[str] = setting(
        doc="experiment trackers rank 0 feeds the config, every metrics row (stepped by env "
        "steps), the summary and the learning curve: tensorboard, wandb, mlflow (each its "
        "extra); docs/running.md", factory=list)
    tracker_project: str | None = setting(
        None, "the trackers' project: W&B's project and MLflow's experiment (null: "
        "WANDB_PROJECT, MLFLOW_EXPERIMENT_NAME, else rlcomm)")
    tracker_entity: str | None = setting(None, "W&B's entity, a team or user (null: WANDB_ENTITY, "
                                         "else W&B's default)")
    env: EnvConfig = setting(doc="the environment (docs/environments.md)", factory=EnvConfig)
    max_staleness: int = setting(
        0, "weights versions a trainer's data may lag its own (0: lockstep; >= 1: rollouts "
        "collect while trainers update, which learn from data up to that many versions old: "
        "docs/async-rollout.md)"
    )
    verify_weights_every: int = setting(
        10, "every N-th weights version, rollouts check what they loaded against the "
        "trainer's bytes (0: never)"
    )
    model: ModelConfig = setting(doc="the policy: the algorithm's own or a transformer",
                                 factory=ModelConfig)
    data_parallel: str = setting(
        "ddp", "how trainers share the work: ddp (every trainer holds the whole model) or fsdp "
        "(parameters, gradients and optimizer state sharded over DATA_PARALLEL); docs/sharding.md"
    )
    threads: int = setting(
        1, "intra-op threads per rank (torch.set_num_threads); 0: the node's cores over its "
        "ranks. Small models gain nothing from more; SAC's 256-wide networks do, on idle cores"
    )
    # Measured on the learner steps (docs/off-policy.md, "Learner speed"): off by default.
    compile: str = setting(
        "off", "the update step as one compiled function (torch.compile, Inductor): off | "
        "inductor | cpp_wrapper (Inductor's C++ wrapper); the first update compiles"
    )
    min_rollouts: int = setting(
        1, "elastic layouts: live rollout ranks the job needs to go on (they serve every "
        "trainer); below it the trainers wait for joiners (0.8 x the hang timeout) if one can "
        "come, then end the run naming who was lost"
    )
    eval_every: int = setting(
        0, "updates between evaluations of the current weights with the deterministic action, "
        "in a background process beside training (0: none); docs/evaluate.md"
    )
    eval_episodes: int = setting(10, "whole episodes per evaluation")
    eval_seed: int = setting(1_000_000, "episode i of every evaluation resets its env with "
                             "eval_seed + i")
    eval_video: bool = setting(
        False, "record each evaluation's first episode; the run keeps videos/best.mp4 and "
        "videos/last.mp4 (the video extra)"
    )
    stop_on: str = setting(
        "train", "what the target return is compared with: train (the mean return of the last "
        "`window` training episodes) or eval (the last evaluation's mean return)"
    )

    algorithm: ClassVar[type[Algorithm[Any]]]
    # Follows membership epochs: its rollout ranks may leave and join (layout.elastic_rollouts).
    elastic_rollouts: ClassVar[bool] = True
    # Re-runs an update a lost trainer broke, on the survivors (layout.elastic_trainers).
    elastic_trainers: ClassVar[bool] = True
    hparams: Any = None  # the algorithm's settings (an AlgorithmSettings dataclass)

    # What the run reports in result["metrics"] (app/runtime/records/), for sweeps to rank by:
    # the same on every rank; after a resume, rates and times cover this attempt only.
    metrics: ClassVar[LoopMetrics] = LoopMetrics(
        {
            "env_steps_per_s": "max",
            "time_to_target_s": "min",  # None when the target return was not reached
            "env_steps_to_target": "min",  # None when the target return was not reached
            "reached_target": "max",  # 1 or 0
            "updates_per_s": "max",
            "transfer_s": "min",  # weight-transfer time per trainer
            "transfer_share": "min",  # weight-transfer time / trainer loop time
            "trainer_wait_fraction": "min",  # trainers blocked on rollouts' trajectories
            "rollout_wait_fraction": "min",  # rollouts blocked on trainers (weights, hand-off)
            "final_mean_return": "max",
            "eval_return_mean": "max",  # the last evaluation's (None without one)
            "best_eval_return": "max",  # the best evaluation's: checkpoints/best
        },
        headline=("time_to_target_s", "env_steps_to_target", "env_steps_per_s",
                  "transfer_share", "trainer_wait_fraction", "rollout_wait_fraction"),
    )

    def __post_init__(self) -> None:
        # Built from config nodes (the app instantiates loops with _recursive_=False, so that
        # loop.env._target_ is not called) or plain mappings: made into the dataclasses.
        settings_type = typing.get_type_hints(type(self))["hparams"]
        if not isinstance(self.hparams, AlgorithmSettings):
            self.hparams = settings_type(**plain(self.hparams))
        if not isinstance(self.env, EnvConfig):
            self.env = EnvConfig(**plain(self.env))
        if not isinstance(self.model, ModelConfig):
            self.model = ModelConfig(**plain(self.model))
        self.env.kwargs = plain(self.env.kwargs)

    @cached_property
    def spaces(self) -> Spaces:
        """The environment's spaces, from one env built once (errors name the setting), or
        as the launcher's validation probed them (they travel with this loop: __getstate__)."""
        return probe_spaces(self.env)

    def __getstate__(self) -> dict[str, Any]:
        """The settings, and the spaces validation probed when they pickle: the launcher sends
        this loop to its ranks, which then build no env to learn them again. Spaces that do not
        pickle (a custom space holding a lambda) stay here: the ranks then probe them."""
        state = dict(self.__dict__)
        if "spaces" in state:
            try:
                pickle.dumps(state["spaces"])
            except Exception:
                del state["spaces"]
        return state

    def build_algorithm(self, spaces: Spaces) -> Algorithm[Any]:
        """The algorithm these settings name, set to compile its update as ``compile`` says; a
        loop that gives it more (an off-policy loop: its replay) overrides this."""
        algorithm = self.algorithm(self.hparams, spaces)
        algorithm.compile_mode = self.compile
        return algorithm


def plain(node: Any) -> dict[str, Any]:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    return dict(node or {})
