"""CartPole that counts its constructions: each one appends a line to ``<count_dir>/<who>``,
``who`` being the process's ``RANK`` (``rank<N>``) or ``launcher`` where none is set. A test
reads which processes built an env, and how many (tests/e2e/test_env_probe.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gymnasium as gym


def make_counting_env(count_dir: str) -> gym.Env[Any, Any]:
    rank = os.environ.get("RANK")
    who = f"rank{rank}" if rank is not None else "launcher"
    with open(Path(count_dir) / who, "a") as out:
        out.write(f"{os.getpid()}\n")
    return gym.make("CartPole-v1")


def constructions(count_dir: Path) -> dict[str, int]:
    """Envs built, by process (``rank<N>`` or ``launcher``)."""
    return {path.name: len(path.read_text().splitlines()) for path in count_dir.iterdir()}
