"""``python -m benchmarks.cleanrl_sac``'s CleanRL side as a real child process: a stand-in for
CleanRL's ``sac_continuous_action.py`` in a checkout laid out as CleanRL's (the script in
``cleanrl/``, ``cleanrl_utils`` beside it) gets the step budget, seed and flags, finds
``cleanrl_utils``, and its printed returns and wall time come back; one that prints none says
to use CleanRL's own Python (docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import cleanrl_sac

pytestmark = pytest.mark.integration

STAND_IN = '''
import sys
import cleanrl_utils  # CleanRL's scripts import it from the checkout's root
argv = sys.argv[1:]
steps = int(argv[argv.index("--total-timesteps") + 1])
assert argv[argv.index("--env-id") + 1] == "Hopper-v4", argv
assert argv[argv.index("--seed") + 1] == "3", argv
assert {"--no-cuda", "--no-track", "--no-capture-video"} <= set(argv), argv
if PRINTS:
    import time
    for step in range(100, steps + 1, 100):
        print(f"global_step={step}, episodic_return=[{step / 10}]")  # no flush, as CleanRL
        if step == 500:
            time.sleep(0.5)
'''


def _checkout(tmp_path: Path, prints: bool) -> Path:
    (tmp_path / "checkout" / "cleanrl_utils").mkdir(parents=True)
    (tmp_path / "checkout" / "cleanrl_utils" / "__init__.py").write_text("")
    script = tmp_path / "checkout" / "cleanrl" / "sac_continuous_action.py"
    script.parent.mkdir()
    script.write_text(STAND_IN.replace("PRINTS", str(prints)))
    return script


def test_the_cleanrl_side_runs_the_script_with_the_budget_and_reads_its_returns(
        tmp_path: Path) -> None:
    script = _checkout(tmp_path, prints=True)
    args = cleanrl_sac.parse_args(["--cleanrl-script", str(script), "--cleanrl-python",
                                   sys.executable, "--steps", "1000", "--seeds", "3",
                                   "--last", "4"])
    side = cleanrl_sac.run_cleanrl(args, 3, tmp_path / "out")
    assert side.problem == ""
    assert [step for step, _, _ in side.episodes] == list(range(100, 1001, 100))
    assert side.final_return == pytest.approx((70 + 80 + 90 + 100) / 4)
    assert side.env_steps == 1000 and side.wall_s is not None and side.wall_s > 0
    # Each line is stamped when printed (not when the pipe's buffer fills), for the curve
    # against wall time: the pause after step 500 shows between its line and the next.
    seconds = [t for _, t, _ in side.episodes]
    assert seconds[5] - seconds[4] >= 0.4 and seconds[4] - seconds[0] < 0.4
    assert (tmp_path / "out" / "cleanrl_s3" / "stdout.txt").read_text().count("episodic") == 10


def test_a_cleanrl_run_without_returns_says_to_use_cleanrls_own_python(tmp_path: Path) -> None:
    script = _checkout(tmp_path, prints=False)
    args = cleanrl_sac.parse_args(["--cleanrl-script", str(script), "--steps", "1000",
                                   "--seeds", "3"])
    side = cleanrl_sac.run_cleanrl(args, 3, tmp_path / "out")
    assert side.episodes == [] and side.final_return is None
    assert "--cleanrl-python" in side.problem
