"""The async vector env (app/runtime/envs/vector.py) keeps the vector env contract: one process per
env, so these are integration tests; the sync kind's are tests/unit/test_envs.py, and both run
the checks of tests/helpers/vector_envs.py."""

from __future__ import annotations

import pytest

from tests.helpers.vector_envs import (
    check_image_env_by_factory_and_by_id,
    check_same_seed_same_run,
    check_step_for_step,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_vector_env_is_its_single_envs_step_for_step(env_id: str) -> None:
    check_step_for_step("async", env_id)


def test_same_seed_same_run() -> None:
    check_same_seed_same_run("async")


def test_image_env_by_factory_and_by_id() -> None:
    check_image_env_by_factory_and_by_id("async")
