"""``python -m benchmarks --only learner_speed``'s plumbing, cut to DQN and a stand-in for
CleanRL's ``dqn.py`` in a checkout laid out as CleanRL's: both sides run back to back, and the
dated section carries the wall times, returns, env steps/s, the ratio, our time split and the
load average; without ``--cleanrl`` the section is one skipped row (docs/benchmarks.md)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

from benchmarks import learner_speed
from benchmarks.core import Settings
from tests.helpers.apprun import MARKER, assert_no_survivors

pytestmark = pytest.mark.e2e

STAND_IN = '''
import sys, time
import cleanrl_utils  # CleanRL's scripts import it from the checkout's root
assert "--env-id" in sys.argv and "CartPole-v1" in sys.argv, sys.argv
for step in range(50, 5001, 50):
    print(f"global_step={step}, episodic_return=[{min(500.0, step / 5)}]", flush=True)
    time.sleep(0.01)
'''


def test_the_quick_dqn_pair_runs_both_sides_and_writes_the_dated_section(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "checkout" / "cleanrl_utils").mkdir(parents=True)
    (tmp_path / "checkout" / "cleanrl_utils" / "__init__.py").write_text("")
    (tmp_path / "checkout" / "cleanrl").mkdir()
    (tmp_path / "checkout" / "cleanrl" / "dqn.py").write_text(STAND_IN)
    monkeypatch.setattr(learner_speed, "PAIRINGS", {"dqn": learner_speed.PAIRINGS["dqn"]})
    marker = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, marker)  # every process our side starts carries it
    settings = Settings(quick=True, out_dir=tmp_path / "bench",
                        cleanrl=tmp_path / "checkout" / "cleanrl" / "ppo.py",
                        cleanrl_python=sys.executable)
    try:
        rows = learner_speed.run(settings)
    finally:
        assert_no_survivors(marker)
    # The smoke's 20 s reach no target: it compares launch to exit.
    assert [r.name for r in rows] == ["dqn: wall time, ours / CleanRL",
                                      "dqn: final return, last 20"]
    assert rows[0].status == "ok" and rows[0].ratio is not None
    pair = rows[0].extra["pairs"][0]
    assert pair["cleanrl"]["problem"] == "" and pair["cleanrl"]["target_s"] > 0
    assert pair["ours"]["wall_s"] > 0 and pair["ours"]["env_steps"] >= 2048
    assert sum(pair["split"].values()) == pytest.approx(1.0, abs=0.05)
    section = (tmp_path / "bench" / "learner_speed" / "results.md").read_text()
    assert section.startswith("## The learner against CleanRL, 20")
    lines = [line for line in section.splitlines() if line.startswith("| dqn | 1 |")]
    assert [line.split("|")[3].strip() for line in lines] == ["CleanRL", "ours"], section
    assert " / " in lines[1].split("|")[9] and lines[1].split("|")[10].strip(), section
    assert (tmp_path / "bench" / "learner_speed" / "dqn_learning_curves.png").is_file()


def test_without_a_checkout_the_section_is_skipped(tmp_path: Path) -> None:
    rows = learner_speed.run(Settings(quick=True, out_dir=tmp_path))
    assert [r.status for r in rows] == ["skipped"] and "--cleanrl" in rows[0].note


def test_the_module_refuses_an_unknown_algorithm(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        learner_speed.main(["--cleanrl", str(tmp_path / "ppo.py"), "--algorithms", "td3"])
    assert exit_info.value.code == 2
