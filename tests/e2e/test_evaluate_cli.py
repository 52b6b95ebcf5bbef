"""``python -m app.evaluate`` (app/evaluate/cli.py) on a real finished CartPole run: the greedy
policy's return, the result file that never overwrites, the export, and one line and exit 2
for each bad input."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.apprun import describe, run_app
from tests.helpers.videos import read_frames

pytestmark = pytest.mark.e2e

EVALUATE = (sys.executable, "-m", "app.evaluate")
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def solved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default run (PPO on CartPole until the last 20 episodes return 475), on one rank."""
    run_dir = tmp_path_factory.mktemp("solved")
    proc = run_app("layout=single", "seed=1", "loop.progress=false", f"hydra.run.dir={run_dir}",
                   timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    return run_dir


def evaluate(*args: str) -> tuple[int, str, str]:
    proc = run_app(*args, module=EVALUATE, timeout=TIMEOUT_S)
    return proc.returncode, proc.stdout, proc.stderr


def test_a_solved_run_evaluates_above_475_and_each_evaluation_is_a_new_result(
    solved_run: Path, tmp_path: Path
) -> None:
    export = tmp_path / "policy.pt2"
    code, out, err = evaluate(str(solved_run), "--episodes", "10", "--export", str(export))
    assert code == 0, err
    first = Path(out.strip().splitlines()[-1].removeprefix("result: "))
    result = json.loads(first.read_text())
    assert first.parent.parent == solved_run / "eval"
    assert result["return_mean"] >= 475 and len(result["returns"]) == 10, result
    assert result["deterministic"] is True
    assert f"return {result['return_mean']:.2f}" in out
    # The export acts as the evaluated policy: CartPole's observations in, actions in {0, 1}.
    actions = torch.export.load(str(export)).module()(torch.zeros(7, 4))
    assert actions.shape == (7,) and set(actions.tolist()) <= {0, 1}
    # A second evaluation, sampled this time, writes beside the first and changes nothing of it.
    before = first.read_bytes()
    code, out, err = evaluate(str(solved_run / "checkpoints"), "--stochastic", "--episodes", "2")
    assert code == 0, err
    second = Path(out.strip().splitlines()[-1].removeprefix("result: "))
    assert second != first and first.read_bytes() == before
    assert json.loads(second.read_text())["deterministic"] is False


def test_video_records_every_episode_beside_the_result(solved_run: Path) -> None:
    code, out, err = evaluate(str(solved_run), "--episodes", "2", "--video")
    assert code == 0, err
    result_file = Path(out.strip().splitlines()[-1].removeprefix("result: "))
    result = json.loads(result_file.read_text())
    videos = [Path(v) for v in result["videos"]]
    assert videos == [result_file.parent / f"episode-{i:03d}.mp4" for i in range(2)]
    for video, length in zip(videos, result["lengths"]):
        assert f"video: {video}" in out
        frames = read_frames(video)
        assert len(frames) == length + 1 and frames[length // 2].var() > 100


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns("eval"))
    return to


@pytest.mark.parametrize("case", ["no_checkpoints", "corrupt", "env_not_installed", "no_best",
                                  "not_a_run", "cannot_render"])
def test_bad_input_is_one_line_and_exit_2(case: str, solved_run: Path, tmp_path: Path) -> None:
    run = _copy(solved_run, tmp_path / "run")
    args = [str(run)]
    want = ""
    newest = sorted((run / "checkpoints").glob("ckpt_*.pt"))[-1]
    if case == "no_checkpoints":
        shutil.rmtree(run / "checkpoints")
        want = "holds no checkpoint"
    elif case == "corrupt":
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
        args += ["--checkpoint", str(newest)]
        want = "corrupt"
    elif case == "env_not_installed":
        config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
        config["loop"]["env"]["id"] = "rlcomm_nowhere/Missing-v0"
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
        want = "rlcomm_nowhere"
    elif case == "no_best":
        args += ["--checkpoint", "best"]
        want = "has no checkpoints/best"
    elif case == "cannot_render":  # an env of the user's own, which renders no frames
        config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
        config["loop"]["env"].update(id="RlcommImage-v0",
                                     _target_="tests.helpers.image_env.make_image_env")
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
        args += ["--video"]
        want = "--video: RlcommImage-v0 cannot render"
    else:
        args = [str(tmp_path)]
        want = "not inside a run dir"
    code, out, err = evaluate(*args)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], err
    assert not (run / "eval").exists()


@pytest.mark.parametrize("loop", [
    ("loop=vtrace", "loop.total_env_steps=2048", "loop.progress=false"),
    # Past the replay's learning start (1,000 transitions): the learner has stepped.
    ("loop=dqn", "loop.total_env_steps=2048", "loop.progress=false"),
    # A plugin's settings are its own: added, not overridden.
    ("loop=custom", "loop._target_=examples.reinforce.ReinforceLoop",
     "+loop.total_env_steps=2048", "+loop.progress=false"),
], ids=["vtrace", "dqn", "reinforce_plugin"])
def test_every_shipped_algorithm_evaluates(loop: tuple[str, ...], tmp_path: Path) -> None:
    """V-trace, DQN and the example plugin (PPO: above), a short run each, then one greedy
    episode."""
    run_dir = tmp_path / "run"
    proc = run_app(*loop, "layout=single", f"hydra.run.dir={run_dir}", timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    code, out, err = evaluate(str(run_dir), "--episodes", "1")
    assert code == 0, err
    result = json.loads(Path(out.strip().splitlines()[-1].removeprefix("result: ")).read_text())
    assert result["lengths"][0] >= 1 and result["return_mean"] == result["lengths"][0]
