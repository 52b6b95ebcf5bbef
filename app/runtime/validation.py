"""The checks of the runtime's settings (``loop.*``, app/runtime/settings/schema.py) that the launcher
runs before any rank starts, each failure one line naming the setting and its value: the
ranges (:func:`check_settings`, which builds nothing), the env's spaces, the trainer grid
against the policy and the checkpoint to resume from (:func:`check_env`, which builds them),
and the seeds (:func:`check_seed`). :class:`~app.runtime.loop.RLLoop`'s hooks call them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.api import ConfigError
from app.output.logs import write_console
from app.output.trackers import check_trackers
from app.output.trackers.tensorboard import check_tensorboard
from app.runtime.checkpoints.agreement import (
    policy_shapes,
    resume_mismatch,
    run_settings,
)
from app.runtime.checkpoints.checkpoint import newest_valid_checkpoint
from app.runtime.core.compiling import compile_problem
from app.runtime.core.seeds import seed_problem
from app.runtime.envs.vector import check_env_names
from app.runtime.evaluation.video import render_problem
from app.runtime.models.actor_critic import is_image
from app.runtime.models.transformer import ffn_hidden, transformer_space_problem
from app.runtime.settings.builders import build_policy, cadence
from app.runtime.trainer.trained import DATA_PARALLEL_KINDS, has_tensor_parallel_plan
from rlcomm import LayoutPlan

if TYPE_CHECKING:
    from app.runtime.settings import RunSettings

STOP_ON = ("train", "eval")


def check_settings(settings: RunSettings, plan: LayoutPlan) -> None:
    """The checks that build nothing (no env, no policy): all that a rank of a joined run other
    than rank 0 runs, since rank 0 probes the env for every rank and hands its spaces to them
    (app/launch/rank.py)."""
    per_update = env_steps_per_update(settings, plan)
    # The ranks of a TENSOR_PARALLEL group train one replica on their segments together.
    replicas, _, _ = plan.grid_sizes
    errors = _range_errors(settings, per_update // replicas)
    if not errors and settings.total_env_steps < per_update:
        errors.append(
            f"total_env_steps: must allow at least one update ({per_update} env steps with "
            f"this layout and hparams), got {settings.total_env_steps}"
        )
    if errors:
        raise ConfigError(f"loop.{errors[0]}")
    check_env_names(settings.env)  # a typo in the id fails every rank alike, at once
    # The plan was planned with the run's shape (app/launch/planning.py): elastic_modes is
    # empty unless its rollout ranks may come and go.
    if plan.elastic_modes and settings.min_rollouts > len(plan.rollouts):
        raise ConfigError(f"loop.min_rollouts: {settings.min_rollouts}, but the layout has "
                          f"{len(plan.rollouts)} rollout ranks")
    if settings.tensorboard:
        check_tensorboard()
    check_trackers(settings.trackers)


def check_env(settings: RunSettings, plan: LayoutPlan) -> None:
    """The checks that need the env's spaces (one env probed), a rendering env, the policy or
    the checkpoint to resume from."""
    env, spaces = settings.env, settings.spaces
    if env.normalize_obs and is_image(spaces.observation):
        raise ConfigError(
            f"loop.env.normalize_obs: {env.id} has image observations, which the CNN scales to "
            "[0, 1] itself; got true (set it false)"
        )
    problem = settings.algorithm.space_problem(spaces)
    if problem:
        name = settings.algorithm.__name__
        raise ConfigError(f"loop.env.id: {env.id}: {problem} ({name} cannot act in it)")
    if settings.model.kind == "transformer":
        problem = transformer_space_problem(spaces)
        if problem:
            raise ConfigError(f"loop.env.id: {env.id}: {problem} (loop.model.kind="
                              "transformer cannot act in it)")
    if settings.eval_video:
        problem = render_problem(env)
        if problem:
            raise ConfigError(f"loop.eval_video: {problem}")
    check_grid(settings, plan)
    check_resume(settings)


def check_grid(settings: RunSettings, plan: LayoutPlan) -> None:
    """The trainer grid against the policy: its sizes must split the model
    (docs/sharding.md)."""
    model = settings.model
    _, sequence, tensor = plan.grid_sizes
    if sequence > 1:  # context parallelism: the transformer's window is split
        if model.kind != "transformer":
            raise ConfigError(
                f"loop.model.kind: {model.kind}, but layout.sequence_parallel_size "
                f"{sequence} splits a transformer's window; use loop.model.kind=transformer")
        if model.context % sequence:
            raise ConfigError(f"loop.model.context: {model.context} is not divisible by "
                              f"sequence_parallel_size {sequence}")
    if tensor == 1:
        return
    if model.kind == "transformer":
        hidden = ffn_hidden(model.width)
        if model.heads % tensor:
            raise ConfigError(f"loop.model.heads: {model.heads} is not divisible by "
                              f"tensor_parallel_size {tensor}")
        if hidden % tensor:
            raise ConfigError(f"loop.model.width: {model.width} gives a feed-forward width of "
                              f"{hidden}, not divisible by tensor_parallel_size {tensor}")
        return
    import torch

    with torch.random.fork_rng(devices=[]):
        policy = build_policy(settings, settings.build_algorithm(settings.spaces),
                              settings.spaces)
    if not has_tensor_parallel_plan(policy):
        raise ConfigError(
            f"layout.tensor_parallel_size: {tensor}, but {type(policy).__name__} (loop.model."
            f"kind={model.kind}) has no tensor-parallel plan; use loop.model.kind=transformer "
            "or a module with tensor_parallel_plan()")


def check_resume(settings: RunSettings) -> None:
    """``loop.resume``, resolved and checked in the launcher before any rank starts: the
    checkpoint the ranks will pick (a folder's newest valid one; skipped files and an
    unverifiable old checkpoint are named in a warning line) must verify and agree with this
    run's algorithm, environment, settings and policy shapes (docs/data-safety.md, "Resume is
    checked before launch")."""
    if settings.resume is None:
        return
    import torch

    picked = newest_valid_checkpoint(settings.resume)
    for note in picked.notes():
        write_console(f"warning: {note}")
    spaces = settings.spaces
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
        policy = build_policy(settings, settings.build_algorithm(spaces), spaces)
    problem = resume_mismatch(picked.state, run_settings(settings, spaces),
                              policy_shapes(policy))
    if problem:
        raise ConfigError(problem)


def check_seed(settings: RunSettings, seed: int, plan: LayoutPlan) -> None:
    """The top-level ``seed`` against the seeds every rank derives from it
    (app/runtime/core/seeds.py), run by the launcher after the other checks."""
    updates = settings.total_env_steps // max(1, env_steps_per_update(settings, plan)) + 1
    problem = seed_problem(seed, plan.world_size, settings.hparams.num_envs, updates,
                           envpool=settings.env.vector == "envpool")
    if problem:
        raise ConfigError(problem)


def env_steps_per_update(settings: RunSettings, plan: LayoutPlan) -> int:
    """Env steps per update: every collecting rank's ``num_envs`` x ``num_steps``."""
    collectors = len(plan.rollouts) if plan.rollouts else len(plan.trainers)
    return int(collectors * settings.hparams.num_envs * settings.hparams.num_steps)


def _range_errors(settings: RunSettings, batch_per_trainer: int) -> list[str]:
    """Every setting out of its range, as ``<field>: must be ..., got value``."""
    errors = [f"hparams.{e}" for e in settings.hparams.range_errors(batch_per_trainer)]
    errors += settings.env.range_errors()
    errors += [f"model.{e}" for e in settings.model.range_errors()]
    if settings.data_parallel not in DATA_PARALLEL_KINDS:
        errors.append(f"data_parallel: must be one of {', '.join(DATA_PARALLEL_KINDS)}, "
                      f"got {settings.data_parallel!r}")
    if settings.window < 1:
        errors.append(f"window: must be a positive integer, got {settings.window}")
    errors += cadence(settings).range_errors()
    checks = [
        ("max_staleness", settings.max_staleness >= 0, ">= 0"),
        ("verify_weights_every", settings.verify_weights_every >= 0, ">= 0"),
        ("threads", settings.threads >= 0, ">= 0"),
        ("min_rollouts", settings.min_rollouts >= 1, ">= 1"),
    ]
    errors += [f"{name}: must be {want}, got {getattr(settings, name)}"
               for name, ok, want in checks if not ok]
    if problem := compile_problem(settings.compile):
        errors.append(f"compile: {problem}")
    elif settings.compile != "off" and not settings.algorithm.compiles:
        errors.append(f"compile: {settings.algorithm.__name__} does not compile its update, "
                      f"got {settings.compile!r} (set off)")
    return errors + _eval_errors(settings)


def _eval_errors(settings: RunSettings) -> list[str]:
    checks = [
        ("eval_every", settings.eval_every >= 0, ">= 0"),
        ("eval_episodes", settings.eval_episodes >= 1, "a positive integer"),
        ("eval_seed", settings.eval_seed >= 0, ">= 0"),
        ("stop_on", settings.stop_on in STOP_ON, f"one of {', '.join(STOP_ON)}"),
    ]
    errors = [f"{name}: must be {want}, got {getattr(settings, name)!r}"
              for name, ok, want in checks if not ok]
    if not errors and settings.stop_on == "eval" and not settings.eval_every:
        errors.append("stop_on: must be train without evaluations (loop.eval_every=0), "
                      "got 'eval'")
    if not errors and settings.eval_video and not settings.eval_every:
        errors.append("eval_video: must be false without evaluations (loop.eval_every=0), "
                      "got true")
    return errors
