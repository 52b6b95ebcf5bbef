"""``python -m benchmarks.learner_step``: PPO's and DQN's learner steps counted and timed per
``loop.compile`` mode and lever, and the twin-Q ensemble it measures is SAC's update to rounding
(docs/benchmarks.md)."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks import learner_step
from benchmarks.sac_step import step_times

pytestmark = pytest.mark.unit


def _rows(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[list[str]]:
    threads = torch.get_num_threads()
    try:
        assert learner_step.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in lines[1:]]


def test_ppo_and_dqn_steps_are_counted_and_timed(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(capsys, ["--algorithms", "ppo,dqn", "--threads", "1", "--rounds", "1",
                          "--steps", "2"])
    assert [(r[0], r[1], r[2]) for r in rows] == [("ppo", "1", "off"), ("dqn", "1", "off")]
    # By hand: PPO's minibatch of 128 through two 11-64-64 MLPs, forward and backward, about
    # 7 MFLOP; DQN's 128 through 4-120-84-2 three times and backward once, about 14 MFLOP.
    assert 0.005 < float(rows[0][4]) < 0.01 and 0.01 < float(rows[1][4]) < 0.02, rows
    assert all(float(r[5].removesuffix(" ms")) > 0 for r in rows)


def test_a_lever_is_timed_against_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(capsys, ["--algorithms", "ppo,sac", "--threads", "1", "--rounds", "1",
                          "--steps", "1", "--lever", "fused_adam"])
    assert [(r[0], r[2]) for r in rows] == [("ppo", "default"), ("ppo", "fused_adam")]


def test_the_twin_q_ensemble_is_sacs_update_to_rounding() -> None:
    plain = learner_step.LEARNERS["sac"]("off")
    with learner_step.LEVERS["twin_q_ensemble"][2]():
        twin = learner_step.LEARNERS["sac"]("off")
        for _ in range(4):
            twin.step()
    for _ in range(4):
        plain.step()
    linears = [m for m in plain.net.q1 if isinstance(m, torch.nn.Linear)]
    for layer, weights in zip(linears, twin.net.q1.weights, strict=True):
        torch.testing.assert_close(weights[0], layer.weight.T, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(twin.net.actor.mean.weight, plain.net.actor.mean.weight,
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["ppo", "dqn", "sac"])
def test_a_lone_trainer_bare_steps_as_ddp_over_a_group_of_one(algorithm: str) -> None:
    """Why a lone trainer trains its module bare (app/runtime/trainer/trained.py): DDP over a group of
    one changes nothing in the update, only its cost (the ``ddp_of_one`` lever)."""
    import torch.distributed as dist

    bare = learner_step.LEARNERS[algorithm]("off")
    try:
        with learner_step.LEVERS["ddp_of_one"][2]():
            wrapped = learner_step.LEARNERS[algorithm]("off")
            assert isinstance(wrapped.model, torch.nn.parallel.DistributedDataParallel)
            for _ in range(4):
                wrapped.step()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert bare.model is bare.net
    for _ in range(4):
        bare.step()
    untrained = learner_step.LEARNERS[algorithm]("off").net.state_dict()
    moved = []
    for (name, ours), theirs in zip(bare.net.state_dict().items(),
                                    wrapped.net.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        moved.append(not torch.equal(ours, untrained[name]))
    assert sum(moved) >= 2, "four steps moved no weights: the comparison would prove nothing"


def _ms(cell: str) -> float:
    return float(cell.split(" ms")[0])


def test_each_step_is_set_against_its_floor(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(capsys, ["--algorithms", "dqn,sac", "--threads", "1", "--rounds", "2",
                          "--steps", "4", "--floor"])
    assert [(r[0], r[1]) for r in rows] == [("dqn", "1"), ("sac", "1")]
    for r in rows:
        step, framework, arithmetic, floor = (_ms(c) for c in r[2:6])
        assert framework > 0 and arithmetic > 0
        assert floor == pytest.approx(framework + arithmetic, abs=2e-3)
        assert _ms(r[6]) == pytest.approx(step - floor, abs=2e-3)
    # SAC's 0.6 GFLOP at any CPU's product rate cost milliseconds; its step with no arithmetic
    # (widths and batch of 8) is then mostly the framework: well under the step itself.
    sac = rows[1]
    assert "0.6000 GFLOP" in sac[4] and _ms(sac[3]) < _ms(sac[2])


class _Alternating:
    """A learner whose steps alternate, 1 ms then 5 ms (SAC's Q step, then its Q and actor
    steps): a cycle of two."""

    cycle = 2

    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        time.sleep(0.001 if self.steps % 2 == 0 else 0.005)
        self.steps += 1


def test_a_step_is_timed_over_its_whole_cycle() -> None:
    """One figure per cycle, its time over its steps: never one kind of step alone."""
    learner = _Alternating()
    times = step_times(learner, 8, warmup=1)  # an odd warm-up: the cycles start mid-way
    assert len(times) == 4 and learner.steps == 9
    # Each figure holds a 1 ms and a 5 ms sleep, so at least 3 ms (a lone 1 ms step: the bug).
    assert all(0.003 <= t < 1.0 for t in times), times


def test_a_compiled_step_is_profiled_kernel_by_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    """``--profile dqn --compile inductor``: a table of every kernel Inductor generated (how the
    docs find SAC's slow mask kernels), where the eager profile has none; even where this
    process compiled the same step before, without them."""
    earlier = learner_step.DQNLearner("inductor")
    for _ in range(3):
        earlier.step()
    assert learner_step.main(["--profile", "dqn", "--compile", "inductor"]) == 0
    compiled = capsys.readouterr().out
    assert "aten::addmm" in compiled and "Inductor's kernels" in compiled, compiled
    kernels = compiled.split("Inductor's kernels")[1]
    # DQN's loss and its backward fuse at least the two ReLUs and their backward.
    assert kernels.count("_cpp_fused_relu") >= 2, kernels
    assert kernels.count("_cpp_fused_") >= 3, kernels
    assert learner_step.main(["--profile", "dqn"]) == 0
    eager = capsys.readouterr().out
    assert "aten::addmm" in eager and "_cpp_fused_" not in eager
