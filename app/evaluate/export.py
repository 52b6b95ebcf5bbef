"""The deterministic policy as a ``torch.export`` program that runs with torch alone.

The program takes a batch of raw observations, as the environment gives them (a float tensor
``[B, *obs_shape]``, uint8 for images; a policy with a history takes windows
``[B, context, obs_dim + 1]``), and returns the batch of greedy actions. Observation
normalisation is part of it, with the statistics frozen at export. Its weights are exported as
constants of inference (``requires_grad=False``): its actions carry no ``grad_fn``, so a caller
records no autograd for them, with or without ``torch.no_grad()``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from app.runtime.core.algorithm import Algorithm
from app.runtime.rollout.worker import Agent


class GreedyPolicy(nn.Module):
    """Raw observations in, greedy actions out: the agent's normalisation, then
    :meth:`Algorithm.greedy` on its acting module."""

    def __init__(self, algorithm: Algorithm, agent: Agent) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.agent = agent

    def forward(self, obs: Tensor) -> Tensor:
        seen = self.agent.observe_window(obs) if self.agent.context else self.agent.observe(obs)
        return self.algorithm.greedy(self.agent.net, seen)


def export_policy(algorithm: Algorithm, agent: Agent, example_obs: Tensor, path: Path) -> Path:
    """Write the greedy policy of ``agent`` as a ``.pt2`` program at ``path`` (which must not
    exist: nothing a run wrote is overwritten) and return it. ``example_obs`` is a batch of raw
    observations; the batch size stays dynamic."""
    if path.exists():
        raise FileExistsError(f"--export: {path} exists; choose a new file")
    policy = GreedyPolicy(algorithm, agent).eval()
    batch = torch.export.Dim("batch", min=1)
    # Frozen while exported and saved (the program holds these very parameters), then given
    # back: the agent may go on training or evaluating in this process.
    trainable = [p for p in policy.parameters() if p.requires_grad]
    policy.requires_grad_(False)
    try:
        with torch.no_grad():
            program = torch.export.export(policy, (example_obs,), dynamic_shapes=({0: batch},))
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.export.save(program, path)
    finally:
        for parameter in trainable:
            parameter.requires_grad_(True)
    return path
