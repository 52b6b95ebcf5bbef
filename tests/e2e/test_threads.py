"""``loop.threads`` (docs/configuration.md): a rank's intra-op threads. One update of PPO on
CartPole on one rank: it runs on the threads it was given, and 0 keeps the launcher's rule (the
node's cores over its ranks); more threads than the host's cores is a warning at launch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.apprun import describe, read_result, run_app

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("threads", "expected"), [(3, 3), (0, max(1, os.cpu_count() or 1))])
def test_a_rank_runs_on_the_threads_it_is_given(threads: int, expected: int,
                                                tmp_path: Path) -> None:
    proc = run_app("layout=single", f"loop.threads={threads}", "loop.total_env_steps=1024",
                   "loop.progress=false", "loop.checkpoint_every=0", f"hydra.run.dir={tmp_path}",
                   timeout=120)
    assert proc.returncode == 0, describe(proc)
    rank = read_result(tmp_path)["ranks"][0]["result"]
    assert rank["updates"] >= 1 and rank["threads"] == expected, (rank["threads"], describe(proc))
    if threads > (os.cpu_count() or 1):  # more threads than cores: the launch warns, once
        assert (proc.stdout + proc.stderr).count(f"loop.threads={threads} x 1 rank on") == 1, \
            describe(proc)
