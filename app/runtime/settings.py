"""The runtime's settings (``loop.*``): their schema, the checks the launcher runs before any
rank starts, and what they build (the algorithm, the policy, the stop rule). One rank's run
(app/runtime/run.py) reads them; :class:`~app.runtime.loop.RLLoop` adds the entry every rank
calls.
"""

from __future__ import annotations

import pickle
import typing
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from omegaconf import DictConfig, OmegaConf
from torch import nn

from app.api import ConfigError, LoopMetrics, setting
from app.output.logs import write_console
from app.output.progress import StopRule
from app.output.trackers import FOLDERS, Tracking, check_trackers
from app.output.trackers.tensorboard import check_tensorboard
from app.runtime.algorithm import Algorithm, AlgorithmSettings, Spaces
from app.runtime.checkpoints.cadence import DEFAULT_INTERVAL_S, DEFAULT_KEEP, Cadence
from app.runtime.checkpoints.checkpoint import (
    CHECKPOINT_DIR,
    newest_valid_checkpoint,
    policy_shapes,
    resume_mismatch,
    run_settings,
)
from app.runtime.compiling import compile_problem
from app.runtime.envs.vector import EnvConfig, check_env_names, ensure_registered, probe_spaces
from app.runtime.evaluation.video import render_problem
from app.runtime.models.actor_critic import ModelConfig, is_image
from app.runtime.models.transformer import (
    TransformerActorCritic,
    ffn_hidden,
    transformer_space_problem,
)
from app.runtime.seeds import seed_problem
from app.runtime.sharding import DATA_PARALLEL_KINDS, has_tensor_parallel_plan
from rlcomm import LayoutPlan

STOP_ON = ("train", "eval")


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

    def validate(self, plan: LayoutPlan) -> None:
        """Range checks and the environment's, run by the launcher before any rank starts."""
        self.validate_settings(plan)
        self.validate_env(plan)

    def validate_settings(self, plan: LayoutPlan) -> None:
        """The checks of :meth:`validate` that build nothing (no env, no policy): all that a
        rank of a joined run other than rank 0 runs, since rank 0 probes the env for every rank
        and hands its spaces to them (app/launch/rank.py)."""
        per_update = self._per_update(plan)
        # The ranks of a TENSOR_PARALLEL group train one replica on their segments together.
        replicas, _, _ = plan.grid_sizes
        batch_per_trainer = per_update // replicas
        errors = [f"hparams.{e}" for e in self.hparams.range_errors(batch_per_trainer)]
        errors += self.env.range_errors()
        errors += [f"model.{e}" for e in self.model.range_errors()]
        if self.data_parallel not in DATA_PARALLEL_KINDS:
            errors.append(f"data_parallel: must be one of {', '.join(DATA_PARALLEL_KINDS)}, "
                          f"got {self.data_parallel!r}")
        if self.window < 1:
            errors.append(f"window: must be a positive integer, got {self.window}")
        errors += self.cadence().range_errors()
        if self.max_staleness < 0:
            errors.append(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.verify_weights_every < 0:
            errors.append(f"verify_weights_every: must be >= 0, got {self.verify_weights_every}")
        if self.threads < 0:
            errors.append(f"threads: must be >= 0, got {self.threads}")
        if self.min_rollouts < 1:
            errors.append(f"min_rollouts: must be >= 1, got {self.min_rollouts}")
        if problem := compile_problem(self.compile):
            errors.append(f"compile: {problem}")
        elif self.compile != "off" and not self.algorithm.compiles:
            errors.append(f"compile: {self.algorithm.__name__} does not compile its update, "
                          f"got {self.compile!r} (set off)")
        errors += self._eval_errors()
        if not errors and self.total_env_steps < per_update:
            errors.append(
                f"total_env_steps: must allow at least one update ({per_update} env steps with "
                f"this layout and hparams), got {self.total_env_steps}"
            )
        if errors:
            raise ConfigError(f"loop.{errors[0]}")
        check_env_names(self.env)  # a typo in the id fails every rank alike, at once
        if plan.elastic_rollouts and plan.rollouts and self.min_rollouts > len(plan.rollouts):
            raise ConfigError(f"loop.min_rollouts: {self.min_rollouts}, but the layout has "
                              f"{len(plan.rollouts)} rollout ranks")
        if self.tensorboard:
            check_tensorboard()
        check_trackers(self.trackers)

    def validate_env(self, plan: LayoutPlan) -> None:
        """The checks of :meth:`validate` that need the env's spaces (one env probed), a
        rendering env, the policy or the checkpoint to resume from."""
        if self.env.normalize_obs and is_image(self.spaces.observation):
            raise ConfigError(
                f"loop.env.normalize_obs: {self.env.id} has image observations, which the CNN "
                "scales to [0, 1] itself; got true (set it false)"
            )
        problem = self.algorithm.space_problem(self.spaces)
        if problem:
            name = self.algorithm.__name__
            raise ConfigError(f"loop.env.id: {self.env.id}: {problem} ({name} cannot act in it)")
        if self.model.kind == "transformer":
            problem = transformer_space_problem(self.spaces)
            if problem:
                raise ConfigError(f"loop.env.id: {self.env.id}: {problem} (loop.model.kind="
                                  "transformer cannot act in it)")
        if self.eval_video:
            problem = render_problem(self.env)
            if problem:
                raise ConfigError(f"loop.eval_video: {problem}")
        self.check_grid(plan)
        self.check_resume()

    def _eval_errors(self) -> list[str]:
        checks = [
            ("eval_every", self.eval_every >= 0, ">= 0"),
            ("eval_episodes", self.eval_episodes >= 1, "a positive integer"),
            ("eval_seed", self.eval_seed >= 0, ">= 0"),
            ("stop_on", self.stop_on in STOP_ON, f"one of {', '.join(STOP_ON)}"),
        ]
        errors = [f"{name}: must be {want}, got {getattr(self, name)!r}"
                  for name, ok, want in checks if not ok]
        if not errors and self.stop_on == "eval" and not self.eval_every:
            errors.append("stop_on: must be train without evaluations (loop.eval_every=0), "
                          "got 'eval'")
        if not errors and self.eval_video and not self.eval_every:
            errors.append("eval_video: must be false without evaluations (loop.eval_every=0), "
                          "got true")
        return errors

    def _per_update(self, plan: LayoutPlan) -> int:
        """Env steps per update: every collecting rank's ``num_envs`` x ``num_steps``."""
        collectors = len(plan.rollouts) if plan.rollouts else len(plan.trainers)
        return int(collectors * self.hparams.num_envs * self.hparams.num_steps)

    def check_seed(self, seed: int, plan: LayoutPlan) -> None:
        """The top-level ``seed`` against the seeds every rank derives from it
        (app/runtime/seeds.py), run by the launcher after :meth:`validate`."""
        updates = self.total_env_steps // max(1, self._per_update(plan)) + 1
        problem = seed_problem(seed, plan.world_size, self.hparams.num_envs, updates,
                               envpool=self.env.vector == "envpool")
        if problem:
            raise ConfigError(problem)

    def build_algorithm(self, spaces: Spaces) -> Algorithm[Any]:
        return self.compiling(self.algorithm(self.hparams, spaces))

    def cadence(self) -> Cadence:
        """When trainers checkpoint and what they keep (app/runtime/checkpoints/cadence.py)."""
        return Cadence(self.checkpoint_every, self.checkpoint_every_s, self.checkpoint_keep,
                       self.milestone_every, self.milestone_every_s)

    def compiling(self, algorithm: Algorithm[Any]) -> Algorithm[Any]:
        """``algorithm``, set to compile its update as ``loop.compile`` says."""
        algorithm.compile_mode = self.compile
        return algorithm

    def build_policy(self, algorithm: Algorithm[Any], spaces: Spaces) -> nn.Module:
        """The module the run trains and acts with: the algorithm's own, or the transformer
        ``loop.model`` describes."""
        if self.model.kind != "transformer":
            return algorithm.build()
        model = self.model
        return TransformerActorCritic(spaces, model.width, model.layers, model.heads,
                                      model.context)

    def check_grid(self, plan: LayoutPlan) -> None:
        """The trainer grid against the policy: its sizes must split the model
        (docs/sharding.md)."""
        _, sequence, tensor = plan.grid_sizes
        if sequence > 1:  # context parallelism: the transformer's window is split
            if self.model.kind != "transformer":
                raise ConfigError(
                    f"loop.model.kind: {self.model.kind}, but layout.sequence_parallel_size "
                    f"{sequence} splits a transformer's window; use loop.model.kind=transformer")
            if self.model.context % sequence:
                raise ConfigError(f"loop.model.context: {self.model.context} is not divisible "
                                  f"by sequence_parallel_size {sequence}")
        if tensor == 1:
            return
        if self.model.kind == "transformer":
            hidden = ffn_hidden(self.model.width)
            if self.model.heads % tensor:
                raise ConfigError(f"loop.model.heads: {self.model.heads} is not divisible by "
                                  f"tensor_parallel_size {tensor}")
            if hidden % tensor:
                raise ConfigError(f"loop.model.width: {self.model.width} gives a feed-forward "
                                  f"width of {hidden}, not divisible by tensor_parallel_size "
                                  f"{tensor}")
            return
        import torch

        with torch.random.fork_rng(devices=[]):
            policy = self.build_policy(self.build_algorithm(self.spaces), self.spaces)
        if not has_tensor_parallel_plan(policy):
            raise ConfigError(
                f"layout.tensor_parallel_size: {tensor}, but {type(policy).__name__} (loop.model."
                f"kind={self.model.kind}) has no tensor-parallel plan; use loop.model.kind="
                "transformer or a module with tensor_parallel_plan()")

    def check_resume(self) -> None:
        """``loop.resume``, resolved and checked in the launcher before any rank starts: the
        checkpoint the ranks will pick (a folder's newest valid one; skipped files and an
        unverifiable old checkpoint are named in a warning line) must verify and agree with
        this run's algorithm, environment, settings and policy shapes
        (docs/data-safety.md, "Resume is checked before launch")."""
        if self.resume is None:
            return
        import torch

        picked = newest_valid_checkpoint(self.resume)
        for note in picked.notes():
            write_console(f"warning: {note}")
        with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
            policy = self.build_policy(self.build_algorithm(self.spaces), self.spaces)
        problem = resume_mismatch(picked.state, run_settings(self, self.spaces),
                                  policy_shapes(policy))
        if problem:
            raise ConfigError(problem)

    def target(self) -> float | None:
        """The return that ends the run: ``target_return``, else the env's reward_threshold."""
        if self.target_return is not None:
            return self.target_return
        if self.env._target_:
            return None
        import gymnasium as gym

        ensure_registered(self.env.id)
        try:
            threshold = gym.spec(self.env.id).reward_threshold
        except gym.error.Error:  # an envpool task id: gymnasium does not know it
            return None
        return float(threshold) if threshold is not None else None

    def tracking(self, resumed_from: Path | None) -> Tracking | None:
        """The trackers rank 0 opens (``trackers`` and ``tensorboard``), None for none;
        ``resumed_from``: the checkpoint the run resumed from, whose trackers go on."""
        names = tuple(dict.fromkeys([*self.trackers, *(["tensorboard"] if self.tensorboard
                                                       else [])]))
        if not names:
            return None
        return Tracking(names, self.tracker_project, self.tracker_entity,
                        params={"loop": asdict(self)}, resumes=resumed_from)

    def stop_rule(self) -> StopRule:
        """What ends a run: the target when there is one (and ``stop_at_target``), else the
        budget alone."""
        return StopRule(self.target() if self.stop_at_target else None, self.window,
                        self.total_env_steps, on_eval=self.stop_on == "eval")

    def summary(self, result: dict[str, Any], run_dir: Path) -> dict[str, Any]:
        """The closing summary's figures and files, from rank 0's result."""
        final = result["mean_return_last_window"]
        return {
            "solved": result["reached_target"],
            "target_return": self.target(),
            "window": self.window,
            "time_to_target_s": result["time_to_target_s"],
            "env_steps_to_target": result["env_steps_to_target"],
            "final_mean_return": final if np.isfinite(final) else None,
            **({"stopped_by": result["stopped_by"]} if result.get("stopped_by") else {}),
            "env_steps": result["env_steps"],
            "updates": result["updates"],
            "train_wall_s": result["wall_s"],
            # As the sweep compares jobs (result["metrics"]): this attempt's rate, all trainers'
            # share of their time spent sending weights.
            "env_steps_per_s": result["metrics"]["env_steps_per_s"],
            "transfer_share": result["metrics"]["transfer_share"],
            **self._eval_summary(result),
            **({"replay": result["replay"]} if "replay" in result else {}),
            "files": {
                name: str(run_dir / name)
                for name in ("metrics.csv", "episodes.csv", "learning_curve.png", CHECKPOINT_DIR,
                             *FOLDERS,
                             "videos/best.mp4", "videos/last.mp4")
                if (run_dir / name).exists()
            },
        }

    def _eval_summary(self, result: dict[str, Any]) -> dict[str, Any]:
        """The last evaluation and the best checkpoint, for a run with evaluations."""
        if not self.eval_every:
            return {}
        last, best = result.get("eval"), result.get("best_checkpoint")
        return {
            "stop_on": self.stop_on,
            "eval_episodes": self.eval_episodes,
            "eval": ({k: last[k] for k in ("return_mean", "return_std", "length_mean",
                                           "version", "update")} if last else None),
            "best_checkpoint": ({k: best[k] for k in ("path", "return_mean", "version",
                                                      "update")} if best else None),
        }


def plain(node: Any) -> dict[str, Any]:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    return dict(node or {})
