"""``python -m app.evaluate``: the policy a run produced, on one process, without a layout.

It rebuilds the env and the policy from the run's own composed config (``.hydra/config.yaml``)
and a verified checkpoint, runs whole episodes, prints mean ± std and each return, and writes
``eval/<time>/result.json`` inside the run dir (a new folder every time), with
``episode-<i>.mp4`` beside it under ``--video``. ``--export FILE`` also writes the greedy
policy as a ``torch.export`` program. Bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from app.api import ConfigError
from app.config import build_loop
from app.evaluate.export import export_policy
from app.output.trackers.fanout import RUN_CONFIG
from app.runtime.checkpoints.checkpoint import newest_valid_checkpoint
from app.runtime.checkpoints.policy import load_policy_state
from app.runtime.core.algorithm import Spaces
from app.runtime.envs.vector import EnvError, probe_spaces
from app.runtime.evaluation.episodes import Episodes, run_episodes
from app.runtime.evaluation.video import render_problem
from app.runtime.rollout.worker import Agent
from app.runtime.settings.builders import build_policy

CONFIG = RUN_CONFIG  # the run's composed config, as Hydra recorded it


class EvaluationError(ValueError):
    """One line for the user; exit 2."""


@dataclass(frozen=True)
class Request:
    target: Path  # a run dir, its checkpoints/ dir, or one checkpoint
    episodes: int
    seed: int
    deterministic: bool
    checkpoint: str  # "last", "best" or a path
    export: Path | None
    video: bool = False


def parse(argv: list[str] | None) -> Request:
    parser = argparse.ArgumentParser(prog="python -m app.evaluate", description=__doc__)
    parser.add_argument("target", type=Path, metavar="RUN_DIR_OR_CHECKPOINT")
    parser.add_argument("--episodes", type=int, default=10, help="episodes to run (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="episode i resets with seed + i")
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                        help="the greedy action (default), or --no-deterministic to sample")
    parser.add_argument("--stochastic", dest="deterministic", action="store_false",
                        help="sample actions, as the run collected them")
    parser.add_argument("--checkpoint", default="last", help="last (default), best, or a PATH")
    parser.add_argument("--export", type=Path, default=None, metavar="FILE",
                        help="also write the greedy policy as a torch.export program (.pt2)")
    parser.add_argument("--video", action="store_true",
                        help="also record every episode as an mp4 beside the result")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error(f"--episodes: must be >= 1, got {args.episodes}")
    if args.seed < 0:
        parser.error(f"--seed: must be >= 0, got {args.seed}")
    return Request(args.target, args.episodes, args.seed, args.deterministic, args.checkpoint,
                   args.export, args.video)


def run_dir_of(target: Path) -> Path:
    """The run dir holding ``target``: the nearest folder, ``target`` included, with a composed
    config."""
    for folder in (target, *target.parents):
        if (folder / CONFIG).is_file():
            return folder
    raise EvaluationError(f"{target}: not inside a run dir (no {CONFIG} above it)")


def checkpoint_path(run_dir: Path, target: Path, choice: str) -> Path:
    """Where ``--checkpoint`` points: a named one of the run, a path, or ``target`` itself."""
    if choice == "best":
        best = run_dir / "checkpoints" / "best"
        if not best.exists():
            raise EvaluationError(f"--checkpoint best: {run_dir} has no checkpoints/best")
        return best
    if choice != "last":
        return Path(choice)
    return target


def evaluate(request: Request) -> tuple[Path, dict[str, Any]]:
    """Run the request; returns the result file and what it holds."""
    run_dir = run_dir_of(request.target.resolve())
    loop = build_loop(OmegaConf.load(run_dir / CONFIG).loop)
    try:
        spaces = probe_spaces(loop.env)
        picked = newest_valid_checkpoint(checkpoint_path(run_dir, request.target,
                                                         request.checkpoint))
        policy = load_policy_state(picked.path)
    except (ConfigError, EnvError) as err:
        raise EvaluationError(str(err).removeprefix("loop.resume: ")) from None
    problem = render_problem(loop.env) if request.video else None
    if problem:
        raise EvaluationError(f"--video: {problem}")
    algorithm = loop.build_algorithm(spaces)
    agent = Agent(build_policy(loop, algorithm, spaces), spaces, loop.env,
                  context=loop.model.history)
    agent.net.load_state_dict(policy)
    for name, value in picked.state.get("normalizers", {}).items():
        agent.get_buffer(name).copy_(value)
    folder = _new_folder(run_dir)
    try:
        videos = ([folder / f"episode-{i:03d}.mp4" for i in range(request.episodes)]
                  if request.video else [])
        episodes = run_episodes(algorithm, agent, loop.env, request.episodes, request.seed,
                                request.deterministic, videos)
        result = _result(request, picked.path, episodes)
        if videos:
            result["videos"] = [str(v) for v in videos]
        if request.export is not None:
            result["export"] = str(export_policy(algorithm, agent, _example(agent, spaces),
                                                 request.export))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # this evaluation's own, new folder
        raise
    path = folder / "result.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path, result


def _example(agent: Agent, spaces: Spaces) -> torch.Tensor:
    """A batch of two raw observations (a history policy's: windows of them, all real steps)
    to trace the export with."""
    sampled = torch.as_tensor(np.stack([spaces.observation.sample() for _ in range(2)]))
    if not agent.context:
        return sampled
    steps = sampled.reshape(2, 1, -1).float().expand(2, agent.context, -1)
    return torch.cat([steps, torch.ones(2, agent.context, 1)], dim=-1)


def _result(request: Request, checkpoint: Path, episodes: Episodes) -> dict[str, Any]:
    return {
        "checkpoint": str(checkpoint), "episodes": request.episodes, "seed": request.seed,
        "deterministic": request.deterministic, "return_mean": episodes.mean_return,
        "return_std": episodes.std_return, "length_mean": episodes.mean_length,
        "returns": episodes.returns, "lengths": episodes.lengths,
    }


def _new_folder(run_dir: Path) -> Path:
    """``eval/<time>/``: a new folder (microseconds in its name, created exclusively), so
    nothing a run or an earlier evaluation wrote is overwritten."""
    folder = run_dir / "eval" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    folder.mkdir(parents=True, exist_ok=False)
    return folder


def main(argv: list[str] | None = None) -> int:
    request = parse(argv)
    try:
        path, result = evaluate(request)
    except (EvaluationError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    mode = "greedy" if request.deterministic else "sampled"
    print(f"{result['episodes']} episodes ({mode} actions) of {result['checkpoint']}: "
          f"return {result['return_mean']:.2f} ± {result['return_std']:.2f}")
    print("returns: " + ", ".join(f"{r:g}" for r in result["returns"]))
    if "export" in result:
        print(f"exported policy: {result['export']}")
    for video in result.get("videos", []):
        print(f"video: {video}")
    print(f"result: {path}")
    return 0
