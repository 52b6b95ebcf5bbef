"""What the runtime's settings (``loop.*``, app/runtime/settings/schema.py) build for a run: the policy,
the checkpoint cadence, the target return and the stop rule, the trackers, and the closing
summary's figures. The algorithm itself is the settings' own ``build_algorithm`` (a subclass
gives it more: an off-policy loop its replay)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import nn

from app.output.progress import StopRule
from app.output.trackers import FOLDERS, Tracking
from app.runtime.checkpoints.cadence import Cadence
from app.runtime.checkpoints.checkpoint import CHECKPOINT_DIR
from app.runtime.core.algorithm import Algorithm, Spaces
from app.runtime.envs.vector import ensure_registered
from app.runtime.models.transformer import TransformerActorCritic

if TYPE_CHECKING:
    from app.runtime.settings import RunSettings


def build_policy(settings: RunSettings, algorithm: Algorithm[Any], spaces: Spaces) -> nn.Module:
    """The module the run trains and acts with: the algorithm's own, or the transformer
    ``loop.model`` describes."""
    if settings.model.kind != "transformer":
        return algorithm.build()
    model = settings.model
    return TransformerActorCritic(spaces, model.width, model.layers, model.heads, model.context)


def cadence(settings: RunSettings) -> Cadence:
    """When trainers checkpoint and what they keep (app/runtime/checkpoints/cadence.py)."""
    return Cadence(settings.checkpoint_every, settings.checkpoint_every_s,
                   settings.checkpoint_keep, settings.milestone_every,
                   settings.milestone_every_s)


def target(settings: RunSettings) -> float | None:
    """The return that ends the run: ``target_return``, else the env's reward_threshold."""
    if settings.target_return is not None:
        return settings.target_return
    if settings.env._target_:
        return None
    import gymnasium as gym

    ensure_registered(settings.env.id)
    try:
        threshold = gym.spec(settings.env.id).reward_threshold
    except gym.error.Error:  # an envpool task id: gymnasium does not know it
        return None
    return float(threshold) if threshold is not None else None


def stop_rule(settings: RunSettings) -> StopRule:
    """What ends a run: the target when there is one (and ``stop_at_target``), else the
    budget alone."""
    return StopRule(target(settings) if settings.stop_at_target else None, settings.window,
                    settings.total_env_steps, on_eval=settings.stop_on == "eval")


def tracking(settings: RunSettings, resumed_from: Path | None) -> Tracking | None:
    """The trackers rank 0 opens (``trackers`` and ``tensorboard``), None for none;
    ``resumed_from``: the checkpoint the run resumed from, whose trackers go on."""
    names = tuple(dict.fromkeys([*settings.trackers,
                                 *(["tensorboard"] if settings.tensorboard else [])]))
    if not names:
        return None
    return Tracking(names, settings.tracker_project, settings.tracker_entity,
                    params={"loop": asdict(settings)}, resumes=resumed_from)


def run_summary(settings: RunSettings, result: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The closing summary's figures and files, from rank 0's result."""
    final = result["mean_return_last_window"]
    return {
        "solved": result["reached_target"],
        "target_return": target(settings),
        "window": settings.window,
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
        **_eval_summary(settings, result),
        **({"replay": result["replay"]} if "replay" in result else {}),
        "files": {
            name: str(run_dir / name)
            for name in ("metrics.csv", "episodes.csv", "learning_curve.png", CHECKPOINT_DIR,
                         *FOLDERS,
                         "videos/best.mp4", "videos/last.mp4")
            if (run_dir / name).exists()
        },
    }


def _eval_summary(settings: RunSettings, result: dict[str, Any]) -> dict[str, Any]:
    """The last evaluation and the best checkpoint, for a run with evaluations."""
    if not settings.eval_every:
        return {}
    last, best = result.get("eval"), result.get("best_checkpoint")
    return {
        "stop_on": settings.stop_on,
        "eval_episodes": settings.eval_episodes,
        "eval": ({k: last[k] for k in ("return_mean", "return_std", "length_mean",
                                       "version", "update")} if last else None),
        "best_checkpoint": ({k: best[k] for k in ("path", "return_mean", "version",
                                                  "update")} if best else None),
    }
