"""The exported policy (app/evaluate/export.py): a ``torch.export`` program that gives the
checkpoint's greedy actions, normalisation included, and runs with torch alone, in a
process where neither ``app`` nor ``rlcomm`` can be imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gymnasium import spaces as gym_spaces

from app.evaluate.export import GreedyPolicy, export_policy
from app.loops.ppo.core import PPO, PPOSettings
from app.runtime.core.algorithm import Spaces
from app.runtime.envs.vector import EnvConfig
from app.runtime.rollout.worker import Agent
from app.runtime.settings.builders import build_policy

pytestmark = pytest.mark.integration

VECTOR = gym_spaces.Box(-np.inf, np.inf, (4,), np.float32)
IMAGE = gym_spaces.Box(0, 255, (36, 36, 1), np.uint8)
CASES = {
    "discrete": (Spaces(VECTOR, gym_spaces.Discrete(3)), True),
    "box": (Spaces(VECTOR, gym_spaces.Box(-2.0, 2.0, (2,), np.float32)), True),
    "image": (Spaces(IMAGE, gym_spaces.Discrete(4)), False),
}

# Torch alone: no site-packages .pth files (the editable install's finder lives in one), only
# the site-packages folder that holds torch; then prove the project cannot be imported.
RUN_ALONE = """
import importlib.util, sys
sys.path.append({site!r})
assert importlib.util.find_spec("app") is None and importlib.util.find_spec("rlcomm") is None
import torch
policy = torch.export.load({program!r}).module()
torch.save(policy(torch.load({obs!r})), {out!r})
"""


def _agent(spaces: Spaces, normalize: bool) -> tuple[PPO, Agent]:
    torch.manual_seed(0)
    algorithm = PPO(PPOSettings(), spaces)
    agent = Agent(algorithm.build(), spaces, EnvConfig(normalize_obs=normalize))
    if agent.obs_norm is not None:  # statistics far from the initial ones, so they matter
        agent.obs_norm.merge(agent.obs_norm.batch_moments(
            torch.randn(500, 4, dtype=torch.float64) * 3 + 5, (4,)))
    return algorithm, agent


def _observations(spaces: Spaces, n: int) -> torch.Tensor:
    if spaces.observation.dtype == np.uint8:
        return torch.randint(0, 256, (n, *spaces.observation.shape), dtype=torch.uint8)
    return torch.randn(n, *spaces.observation.shape) * 3 + 5


@pytest.mark.parametrize("case", list(CASES))
def test_the_exported_policy_gives_the_checkpoints_actions_with_torch_alone(
    case: str, tmp_path: Path
) -> None:
    spaces, normalize = CASES[case]
    algorithm, agent = _agent(spaces, normalize)
    program = export_policy(algorithm, agent, _observations(spaces, 8), tmp_path / "policy.pt2")
    obs = _observations(spaces, 100)
    torch.save(obs, tmp_path / "obs.pt")
    with torch.no_grad():
        want = GreedyPolicy(algorithm, agent)(obs)
        # Normalisation is in the program: without it the actions would differ.
        if normalize:
            assert not torch.equal(algorithm.greedy(agent.net, obs.float()), want)
    script = RUN_ALONE.format(site=str(Path(torch.__file__).parents[1]), program=str(program),
                              obs=str(tmp_path / "obs.pt"), out=str(tmp_path / "out.pt"))
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", script], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    got = torch.load(tmp_path / "out.pt")
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.int64:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want)


def test_export_never_overwrites_a_file(tmp_path: Path) -> None:
    spaces, _ = CASES["discrete"]
    algorithm, agent = _agent(spaces, False)
    target = tmp_path / "policy.pt2"
    target.write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="policy.pt2 exists"):
        export_policy(algorithm, agent, _observations(spaces, 8), target)
    assert target.read_bytes() == b"mine"


# Every shipped algorithm, on an env whose actions it takes, and the transformer policy: the
# loop's own build path, as `python -m app.evaluate RUN --export` takes it.
EVERY_POLICY = {
    "ppo": ("app.loops.ppo.PPOLoop", "CartPole-v1", {}),
    "ppo-box": ("app.loops.ppo.PPOLoop", "Pendulum-v1", {"normalize_obs": True}),
    "ppo-transformer": ("app.loops.ppo.PPOLoop", "CartPole-v1",
                        {"model": {"kind": "transformer", "width": 16, "layers": 1, "heads": 2,
                                   "context": 4}}),
    "vtrace": ("app.loops.vtrace.VTraceLoop", "CartPole-v1", {}),
    "dqn": ("app.loops.dqn.DQNLoop", "CartPole-v1", {}),
    "sac": ("app.loops.sac.SACLoop", "Pendulum-v1", {}),
}

# In a torch-only process, outside torch.no_grad(): the actions must not record autograd.
ACTIONS_ALONE = RUN_ALONE.replace(
    "torch.save(policy(torch.load({obs!r})), {out!r})",
    "actions = policy(torch.load({obs!r}))\n"
    "torch.save({{'requires_grad': actions.requires_grad, 'grad_fn': repr(actions.grad_fn),\n"
    "            'params': [p.requires_grad for p in policy.parameters()]}}, {out!r})")


@pytest.mark.parametrize("case", list(EVERY_POLICY))
def test_the_exported_policy_of_every_algorithm_records_no_autograd(
    case: str, tmp_path: Path
) -> None:
    from app.config.registry import build_loop
    from app.evaluate.cli import _example

    target, env_id, extra = EVERY_POLICY[case]
    model = extra.get("model", {})
    loop = build_loop({"_target_": target, "model": model,
                       "env": {"id": env_id, "normalize_obs": extra.get("normalize_obs", False)}})
    spaces = loop.spaces
    torch.manual_seed(0)
    algorithm = loop.build_algorithm(spaces)
    agent = Agent(build_policy(loop, algorithm, spaces), spaces, loop.env,
                  context=loop.model.history)
    learns = [p.requires_grad for p in agent.parameters()]
    assert any(learns)  # a trainer's policy (SAC's target networks learn not)
    program = export_policy(algorithm, agent, _example(agent, spaces), tmp_path / "policy.pt2")
    # Exporting froze nothing of the agent's own: it may go on training in this process.
    assert [p.requires_grad for p in agent.parameters()] == learns
    obs = torch.cat([_example(agent, spaces)] * 3)  # another batch size than the example's
    torch.save(obs, tmp_path / "obs.pt")
    script = ACTIONS_ALONE.format(site=str(Path(torch.__file__).parents[1]),
                                  program=str(program), obs=str(tmp_path / "obs.pt"),
                                  out=str(tmp_path / "out.pt"))
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", script], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    got = torch.load(tmp_path / "out.pt")
    assert got == {"requires_grad": False, "grad_fn": "None", "params": got["params"]}, got
    assert got["params"] and not any(got["params"]), got
