"""Videos of whole episodes (app/runtime/evaluation/video.py) rendered headless on real envs: classic
control through pygame, MuJoCo through EGL, and one line for an env that cannot render."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from app.loops.ppo.core import PPO, PPOSettings
from app.runtime.core.algorithm import Spaces
from app.runtime.envs.vector import EnvConfig
from app.runtime.evaluation.episodes import run_episodes
from app.runtime.evaluation.video import render_problem
from app.runtime.rollout.worker import Agent
from tests.helpers.videos import read_frames

pytestmark = pytest.mark.integration


def _episodes_with_video(env_id: str, path: Path, seed: int = 0) -> tuple[int, list[np.ndarray]]:
    probe = gym.make(env_id)
    spaces = Spaces(probe.observation_space, probe.action_space)
    probe.close()
    torch.manual_seed(0)
    algorithm = PPO(PPOSettings(), spaces)
    cfg = EnvConfig(id=env_id)
    agent = Agent(algorithm.build(), spaces, cfg)
    done = run_episodes(algorithm, agent, cfg, episodes=2, seed=seed, videos=[path])
    # The first episode alone is recorded: as it was run, the same with or without a video.
    again = run_episodes(algorithm, agent, cfg, episodes=2, seed=seed)
    assert done == again
    return done.lengths[0], read_frames(path)


@pytest.mark.parametrize(("env_id", "size"), [("CartPole-v1", (400, 600)),
                                              ("Hopper-v5", (480, 480))])
def test_an_episode_video_holds_every_step_and_is_not_blank(env_id: str, size: tuple[int, int],
                                                            tmp_path: Path) -> None:
    video = tmp_path / "episode.mp4"
    length, frames = _episodes_with_video(env_id, video)
    assert len(frames) == length + 1  # the reset's frame, then one per step
    assert frames[0].shape == (*size, 3)
    for image in (frames[0], frames[len(frames) // 2], frames[-1]):
        assert image.var() > 100, image.var()  # a scene, not one flat colour
    # The scene moves: the last frame is not the first.
    assert np.abs(frames[-1].astype(int) - frames[0].astype(int)).mean() > 0.1
    assert [p.name for p in tmp_path.iterdir()] == ["episode.mp4"]  # no partial file left


def test_an_env_that_cannot_render_is_one_line() -> None:
    cfg = EnvConfig(id="RlcommImage-v0", _target_="tests.helpers.image_env.make_image_env")
    problem = render_problem(cfg)
    assert problem is not None and problem.startswith("RlcommImage-v0 cannot render"), problem
    assert "\n" not in problem
    assert render_problem(EnvConfig(id="CartPole-v1")) is None
