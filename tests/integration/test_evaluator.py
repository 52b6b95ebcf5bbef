"""Evaluation beside training (app/runtime/evaluation/evaluator.py): the background evaluation process on
a real CartPole policy, shared over a real one-rank gloo group, and ``checkpoints/best``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.loops.ppo import PPOLoop
from app.runtime.checkpoints.checkpoint import TrainingState, WholeCheckpoint, load_checkpoint
from app.runtime.evaluation.episodes import run_episodes
from app.runtime.evaluation.evaluator import BEST, Evaluation, Evaluations
from app.runtime.rollout.worker import Agent
from app.runtime.settings.builders import build_policy
from rlcomm import CommContext, ParallelMode
from rlcomm.plan import LayoutSpec, plan_layout
from rlcomm.testing import free_port, rank_env

pytestmark = pytest.mark.integration


@pytest.fixture
def one_rank() -> Iterator[CommContext]:
    """This process as a world of one rank (gloo on 127.0.0.1)."""
    saved = dict(os.environ)
    os.environ.update(rank_env(0, 1, free_port()))
    ctx = CommContext()
    try:
        ctx.init_distributed_env(backend="gloo", timeout=60)
        ctx.init_groups(plan_layout(LayoutSpec(world_size=1, trainers=[0])))
        yield ctx
    finally:
        ctx.destroy()
        os.environ.clear()
        os.environ.update(saved)


def _controller(loop: PPOLoop, gain: float) -> Agent:
    """CartPole's actor made a fixed controller: pushes toward the pole's lean (angle plus
    angular velocity) times ``gain`` (1: balances, -1: topples it, 0: always left)."""
    algorithm = loop.build_algorithm(loop.spaces)
    agent = Agent(build_policy(loop, algorithm, loop.spaces), loop.spaces, loop.env)
    actor = agent.net.actor
    with torch.no_grad():
        for param in actor.parameters():
            param.zero_()
        actor[0].weight[0, 2:4] = 10.0
        actor[2].weight[0, 0] = 5.0
        actor[4].weight[1, 0], actor[4].weight[0, 0] = gain, -gain
    return agent


def _record(agent: Agent, update: int) -> WholeCheckpoint:
    return WholeCheckpoint(agent.net.state_dict(), {}, TrainingState(update, env_steps=update))


def _evaluate(evaluations: Evaluations, agent: Agent, update: int) -> Evaluation:
    evaluations.submit(update, update, update, agent.state_dict(), _record(agent, update))
    for _ in range(600):  # bounded: 60 s
        arrived = evaluations.share()
        if arrived is not None:
            return arrived
        time.sleep(0.1)
    raise AssertionError("no evaluation within 60 s")


def test_the_best_evaluation_is_kept_and_a_worse_last_one_does_not_replace_it(
        one_rank: CommContext, tmp_path: Path) -> None:
    loop = PPOLoop(eval_every=1, eval_episodes=3, eval_seed=7)
    agents = {gain: _controller(loop, gain) for gain in (-1.0, 1.0, 0.0)}
    # What each policy scores, measured here the way the evaluator measures it.
    expected = {gain: run_episodes(loop.build_algorithm(loop.spaces), agent, loop.env, 3, 7)
                for gain, agent in agents.items()}
    assert expected[1.0].mean_return > max(expected[-1.0].mean_return,
                                           expected[0.0].mean_return)

    evaluations = Evaluations(loop, one_rank, 0, ParallelMode.GLOBAL, tmp_path)
    try:
        found = [_evaluate(evaluations, agents[gain], update)
                 for update, gain in enumerate((-1.0, 1.0, 0.0), start=1)]
    finally:
        evaluations.close()

    assert [e.return_mean for e in found] == pytest.approx(
        [expected[g].mean_return for g in (-1.0, 1.0, 0.0)])
    assert [e.version for e in found] == [1, 2, 3]
    best = load_checkpoint(tmp_path / "checkpoints" / BEST)  # checksum verified
    assert best["update"] == 2
    assert best["eval"]["return_mean"] == pytest.approx(expected[1.0].mean_return)
    for name, value in agents[1.0].net.state_dict().items():
        assert torch.equal(best["policy"][name], value), name
    result = evaluations.result()
    assert result["best_checkpoint"]["update"] == 2
    assert result["eval"]["update"] == 3  # the last one, worse than the best
    assert result["metrics"]["best_eval_return"] > result["metrics"]["eval_return_mean"]


def test_a_resumed_run_replaces_the_best_checkpoint_only_with_a_better_one(
        one_rank: CommContext, tmp_path: Path) -> None:
    loop = PPOLoop(eval_every=1, eval_episodes=2, eval_seed=3)
    good, bad = _controller(loop, 1.0), _controller(loop, -1.0)
    first = Evaluations(loop, one_rank, 0, ParallelMode.GLOBAL, tmp_path)
    try:
        _evaluate(first, good, 1)
    finally:
        first.close()
    again = Evaluations(loop, one_rank, 0, ParallelMode.GLOBAL, tmp_path)  # a later attempt
    try:
        _evaluate(again, bad, 2)
    finally:
        again.close()
    assert load_checkpoint(tmp_path / "checkpoints" / BEST)["update"] == 1
    assert again.result()["best_checkpoint"] is None


_KILLED_RANK = """
import os, signal, sys
from app.loops.ppo import PPOLoop
from app.runtime.evaluation.evaluator import BackgroundEvaluator
evaluator = BackgroundEvaluator(PPOLoop(eval_every=1, eval_episodes=1))
print(evaluator._process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_evaluation_process_ends_when_its_rank_is_killed() -> None:
    rank = subprocess.run([sys.executable, "-c", _KILLED_RANK], capture_output=True, text=True,
                          timeout=120)
    assert rank.returncode == -signal.SIGKILL, rank.stderr
    child = int(rank.stdout.split()[0])
    for _ in range(600):  # bounded: 60 s (it sees its pipe close once it has started)
        if not _alive(child):
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError(f"the evaluation process {child} outlived its killed rank")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended (its parent is gone, init reaps it)


def test_an_evaluation_still_running_when_the_run_ends_is_waited_for_and_kept(
        one_rank: CommContext, tmp_path: Path) -> None:
    loop = PPOLoop(eval_every=1, eval_episodes=3, eval_seed=7)
    low, high = _controller(loop, 0.0), _controller(loop, 1.0)
    evaluations = Evaluations(loop, one_rank, 0, ParallelMode.GLOBAL, tmp_path)
    try:
        first = _evaluate(evaluations, low, 1)
        # The run's last update hands over weights; the budget ends before their result is
        # shared: the rank's finish waits for it.
        evaluations.submit(2, 2, 2, high.state_dict(), _record(high, 2))
        evaluations.finish(60.0)
    finally:
        evaluations.close()
    result = evaluations.result()
    assert result["evaluations"] == 2 and result["eval"]["update"] == 2, result
    assert result["eval"]["return_mean"] > first.return_mean
    best = load_checkpoint(tmp_path / "checkpoints" / BEST)  # checksum verified
    assert best["update"] == 2 and result["best_checkpoint"]["update"] == 2
