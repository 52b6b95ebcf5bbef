"""What a rank of a joined run other than rank 0 validates: the loop's checks that build nothing
(``validate_job(cfg, probe=False)``), the env's id or factory looked up but no env built. The
runs under torchrun: tests/e2e/test_env_probe.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from app.errors import ConfigError
from tests.helpers.apprun import REPO
from tests.helpers.counting_env import constructions

pytestmark = pytest.mark.unit


def test_without_probing_no_env_is_built_and_a_typo_still_fails(tmp_path: Path) -> None:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)
    from app.launch.planning import validate_job

    counting = ["loop.env._target_=tests.helpers.counting_env.make_counting_env",
                f"+loop.env.kwargs.count_dir={tmp_path}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=counting)
        typo = compose("config", overrides=["loop.env.id=CartPol-v1"])
        missing = compose("config", overrides=["loop.env._target_=nosuch.make"])
    _, job = validate_job(cfg, probe=False)
    assert constructions(tmp_path) == {} and "spaces" not in job.loop.__dict__
    validate_job(cfg)  # rank 0's (and a launcher's): one env, for its spaces
    assert constructions(tmp_path) == {"launcher": 1}
    with pytest.raises(ConfigError, match=r"loop\.env\.id: 'CartPol-v1' is not a registered .* "
                                          r"did you mean 'CartPole-v1'"):
        validate_job(typo, probe=False)
    with pytest.raises(ConfigError, match=r"loop\.env\._target_: cannot import 'nosuch\.make'"):
        validate_job(missing, probe=False)
