"""A job that grows and shrinks while it runs, on real processes.

``python -m app.join RUN_DIR role=rollout`` adds a rollout rank the plan did not have: it gets a
new rank number, the trainer leading the fewest rollout ranks admits it at an update boundary
with the current weights, and trains on its segments; it exits with the job. SIGTERM to one
rollout rank (or ``python -m app.leave RUN_DIR rank=N``) makes it leave at its trainer's next
update boundary: the others go on, the leave is recorded with reason ``asked``, and no restart
is spent on it. Bad input to either command is one line, exit 2, and the job is untouched.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.apprun import (
    HANG_S,
    AppProcess,
    app_env,
    collapse,
    column,
    processes_with_marker,
    read_result,
    rows_so_far,
)

pytestmark = pytest.mark.e2e

# On the waiting CartPole (2 ms a step) an update takes about 2 s whatever the rollout ranks
# (they wait in parallel): the run lasts long enough to act on it while it goes, where CartPole
# itself would be done in seconds.
WAITING = ("loop.env.id=WaitingCartPole-v1", "loop.progress=false", "loop.target_return=1e9",
           "comm.timeout=60")
RUN = ("layout=1t3r", *WAITING, "loop.total_env_steps=61440")
JOINER_S = 180  # a joiner's whole life, its imports on a loaded machine included
# Budgets: a run on the waiting env lasts about as long on a loaded machine, while a joiner (a new
# interpreter, its imports) takes several times longer there. A run that must outlast joiners
# leaves them a minute or more.

Joiner = Callable[..., subprocess.Popen[str]]  # start_joiner(run_dir, name, role=...)

def members_by_update(run_dir: Path) -> list[int]:
    return [int(float(row["members"])) for row in rows_so_far(run_dir)]


def side_command(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture
def start_joiner(tmp_path: Path) -> Iterator[Joiner]:
    """``start_joiner(run_dir, name, role="rollout")``: ``python -m app.join RUN_DIR role=...``
    in the background, its output in ``<tmp>/<name>.out``; any still running at teardown is killed and
    fails the test."""
    joiners: list[subprocess.Popen[str]] = []

    def start(run_dir: Path, name: str, role: str = "rollout") -> subprocess.Popen[str]:
        out = (tmp_path / f"{name}.out").open("w")
        joiner = subprocess.Popen([sys.executable, "-m", "app.join", str(run_dir), f"role={role}"],
                                  stdout=out, stderr=subprocess.STDOUT, text=True)
        joiners.append(joiner)
        return joiner

    yield start
    survivors = [j.pid for j in joiners if j.poll() is None]
    for joiner in joiners:
        if joiner.poll() is None:
            joiner.kill()
            joiner.wait(timeout=30)
    assert not survivors, f"joiners still running: {survivors}"


def wait_for_members(app: AppProcess, count: int) -> None:
    app.wait_until(f"{count} members", lambda: (members_by_update(app.run_dir) or [0])[-1] == count,
                   timeout=JOINER_S)


def joins_beyond_the_plan(result: dict[str, Any]) -> list[int]:
    return [join["rank"] for join in result["joins"] if join["reason"] == "beyond the plan"]


def test_two_joiners_one_after_another_grow_a_default_run_from_2_to_3_to_4_rollout_ranks(
    start_app: Callable[..., AppProcess], start_joiner: Joiner,
    tmp_path: Path,
) -> None:
    """The default layout (2t2r); the job is untouched by refused joiners first."""
    app = start_app("grown", *WAITING, "loop.total_env_steps=135000")
    app.wait_until("2 updates", lambda: len(rows_so_far(app.run_dir)) >= 2)
    replica = side_command("app.join", str(app.run_dir), "role=replica")
    assert (replica.returncode, replica.stderr.strip()) == (2, (
        "error: role=replica: this job's trainers form no replica groups "
        "(layout.trainer_replicas=1): one more trainer joins with role=trainer")), replica
    other_env = side_command("app.join", str(app.run_dir), "role=rollout", "loop.env.id=Pong")
    assert (other_env.returncode, other_env.stderr.strip()) == (2, (
        "error: loop.env.id=Pong: a joiner runs the job's own config (.hydra/config.yaml); "
        "only loop.threads may differ")), other_env
    first = start_joiner(app.run_dir, "first")
    wait_for_members(app, 3)
    second = start_joiner(app.run_dir, "second")
    wait_for_members(app, 4)
    assert app.wait() == 0, app.describe()
    for joiner, name in ((first, "first"), (second, "second")):
        assert joiner.wait(timeout=60) == 0, (tmp_path / f"{name}.out").read_text()[-3000:]
    members = members_by_update(app.run_dir)
    assert collapse(members) == [2, 3, 4], members
    result = read_result(app.run_dir)
    assert joins_beyond_the_plan(result) == [4, 5], result["joins"]
    for join in result["joins"]:  # each joiner's first segment was trained on
        assert join["first_segment_lag"] is not None and join["first_trained_s"] is not None
    assert result["leaves"] == []
    reports = {r["rank"]: r for r in result["ranks"]}
    assert sorted(reports) == [0, 1, 2, 3, 4, 5]
    for rank in (4, 5):
        assert reports[rank]["role"] == "rollout" and reports[rank]["result"]["joined"] is True
        assert 0 < reports[rank]["result"]["segments_sent"] < reports[0]["result"]["updates"]
        assert "joins the running job (beyond its plan)" in app.log(rank)
    # The trainers each led one of the joiners (the fewest rollout ranks first).
    assert "rank 4 (rollout, beyond the plan of 4) asks rank 0 to admit it" in \
        (tmp_path / "first.out").read_text()
    assert "rank 5 (rollout, beyond the plan of 4) asks rank 1 to admit it" in \
        (tmp_path / "second.out").read_text()
    assert "rollout ranks: 0 left, 2 joined, grew to 6 ranks" in app.stdout, app.describe()
    finished = side_command("app.join", str(app.run_dir), "role=rollout")
    assert (finished.returncode, finished.stderr.strip()) == (2, (
        f"error: {app.run_dir}: the run finished (result.json); nothing runs there")), finished
    app.assert_all_ended()


def test_a_joiner_grows_a_job_that_torchrun_started(tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 -m app layout=1t1r``: ``python -m app.join``
    finds the job's store (torchrun's) through ``job.json`` and joins beyond the plan."""
    marker, run_dir = uuid.uuid4().hex, tmp_path / "torchrun-grown"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "app", "layout=1t1r", *WAITING, "loop.total_env_steps=46080",
           f"hydra.run.dir={run_dir}"]
    with (tmp_path / "torchrun.out").open("w") as out:
        job = subprocess.Popen(cmd, cwd=tmp_path, env=app_env(marker), stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    joiner: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + JOINER_S
        while len(rows_so_far(run_dir)) < 2:
            assert job.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "torchrun.out").read_text()[-3000:]
            time.sleep(0.1)
        with (tmp_path / "joiner.out").open("w") as out:
            joiner = subprocess.Popen([sys.executable, "-m", "app.join", str(run_dir),
                                       "role=rollout"], cwd=tmp_path, env=app_env(marker),
                                      stdout=out, stderr=subprocess.STDOUT, text=True)
        assert job.wait(timeout=HANG_S) == 0, (tmp_path / "torchrun.out").read_text()[-3000:]
        assert joiner.wait(timeout=60) == 0, (tmp_path / "joiner.out").read_text()[-3000:]
    finally:
        for proc in (job, joiner):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    (join,) = read_result(run_dir)["joins"]
    assert (join["rank"], join["reason"]) == (2, "beyond the plan") and join["first_trained_s"]
    assert collapse(members_by_update(run_dir)) == [1, 2], members_by_update(run_dir)
    deadline = time.monotonic() + 15  # the agent's workers end just after it
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with_marker(marker), processes_with_marker(marker)

def grow_by_a_trainer_and_a_rollout_rank(
    app: AppProcess, start_joiner: Joiner,
) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """After 2 updates, ``role=trainer`` (rank 4) until there are 3 trainers, then
    ``role=rollout`` (rank 5) until there are 3 rollout ranks; the two joiners."""
    app.wait_until("2 updates", lambda: len(rows_so_far(app.run_dir)) >= 2)
    trainer = start_joiner(app.run_dir, "trainer", "trainer")
    app.wait_until("3 trainers", lambda: column(app.run_dir, "trainers")[-1:] == [3],
                   timeout=JOINER_S)
    rollout = start_joiner(app.run_dir, "rollout")
    wait_for_members(app, 3)
    return trainer, rollout


def test_a_trainer_joins_beyond_the_plan_heals_and_leads_the_next_rollout_joiner(
    start_app: Callable[..., AppProcess], start_joiner: Joiner, tmp_path: Path,
) -> None:
    """The default layout (2t2r, elastic trainers): ``role=trainer`` makes ``trainers`` go
    2 -> 3; the joiner heals from the lead (checksums logged) and ends with the others'
    weights; the rollout rank that joins next goes to it, the trainer leading the fewest."""
    app = start_app("trainer-grown", *WAITING, "loop.total_env_steps=135000")
    trainer, rollout = grow_by_a_trainer_and_a_rollout_rank(app, start_joiner)
    assert app.wait() == 0, app.describe()
    for joiner, name in ((trainer, "trainer"), (rollout, "rollout")):
        assert joiner.wait(timeout=60) == 0, (tmp_path / f"{name}.out").read_text()[-3000:]
    assert collapse(column(app.run_dir, "trainers")) == [2, 3], column(app.run_dir, "trainers")
    assert collapse(members_by_update(app.run_dir)) == [2, 3], members_by_update(app.run_dir)
    result = read_result(app.run_dir)
    assert [(j["rank"], j["reason"]) for j in result["trainer_joins"]] == \
        [(4, "beyond the plan")], result["trainer_joins"]
    assert joins_beyond_the_plan(result) == [5], result["joins"]
    healed = re.search(r"rank 4 \(trainer\) healed from rank 0 at update (\d+): \d+ bytes, "
                       r"checksum [0-9a-f]{16} equal on the trainers \[0, 1, 4\]", app.log(0))
    assert healed, app.log(0)[-3000:]
    reports = {r["rank"]: r for r in result["ranks"]}
    assert reports[4]["role"] == "trainer"
    assert reports[4]["result"]["param_checksum"] == reports[0]["result"]["param_checksum"]
    tdp, wt = "TRAIN_DATA_PARALLEL", "WEIGHT_TRANSFER"
    assert reports[4]["groups"][tdp]["ranks"] == [0, 1, 4]
    assert reports[5]["groups"][wt]["ranks"] == [4, 5]  # it went to the trainer that led none
    assert "rank 4 (trainer, beyond the plan of 4) asks rank 0 to admit it" in \
        (tmp_path / "trainer.out").read_text()
    assert "trainers: 0 left, 1 joined, grew to 6 ranks" in app.stdout, app.describe()
    app.assert_all_ended()


def test_a_trainer_sigtermed_alone_leaves_asked_its_rollout_ranks_go_on_and_app_leave_lets_another_go(
    start_app: Callable[..., AppProcess], start_joiner: Joiner, tmp_path: Path,
) -> None:
    """2t2r grown by a trainer (rank 4) and a rollout rank it leads (rank 5): SIGTERM to rank 4
    alone lets it go at the next boundary, exit 0, no restart; rank 5 moves to a trainer that
    goes on. Then ``python -m app.leave RUN_DIR rank=1`` lets the planned trainer 1 go: the
    lead trains on alone with every rollout rank until the run is stopped (SIGTERM: no budget
    can be sure to outlast the joins on a loaded machine)."""
    app = start_app("trainer-leaves", *WAITING, f"loop.total_env_steps={10**9}",
                    "launcher.trainer_restarts=1")
    trainer, rollout = grow_by_a_trainer_and_a_rollout_rank(app, start_joiner)
    trainer.send_signal(signal.SIGTERM)  # the joiner's process is rank 4
    app.wait_until("2 trainers", lambda: column(app.run_dir, "trainers")[-1:] == [2],
                   timeout=JOINER_S)
    assert trainer.wait(timeout=60) == 0, (tmp_path / "trainer.out").read_text()[-3000:]
    asked = side_command("app.leave", str(app.run_dir), "rank=1")
    assert asked.returncode == 0, asked
    assert re.fullmatch(r"rank 1 left the job: the lead trainer let it go from epoch \d+\n",
                        asked.stdout), asked.stdout
    app.wait_until("the lead alone for 2 updates",
                   lambda: column(app.run_dir, "trainers")[-2:] == [1, 1])
    app.proc.send_signal(signal.SIGTERM)
    assert app.wait() == 128 + signal.SIGTERM, app.describe()
    assert rollout.wait(timeout=60) == 0, (tmp_path / "rollout.out").read_text()[-3000:]
    assert collapse(column(app.run_dir, "trainers")) == [2, 3, 2, 1], column(app.run_dir, "trainers")
    assert members_by_update(app.run_dir)[-1] == 3  # no rollout rank left with its trainer
    result = read_result(app.run_dir)
    assert [(c["rank"], c["reason"]) for c in result["trainer_leaves"]] == \
        [(4, "asked"), (1, "asked")], result["trainer_leaves"]
    assert result["summary"]["restarts"] == 0 and "starting it again" not in app.stderr
    assert "rank 4 (trainer): the lead, rank 0, let it go at its request" in app.log(4)
    assert sorted(r["rank"] for r in result["ranks"]) == [0, 2, 3, 5]
    assert result["summary"]["trainers"] == {"left": 2, "joined": 1, "transitions_lost": 0,
                                             "grew_to": 6}, result["summary"]
    app.assert_all_ended()


def test_a_rollout_rank_sigtermed_leaves_asked_without_a_restart_and_a_joiner_takes_its_place(
    start_app: Callable[..., AppProcess], start_joiner: Joiner,
    tmp_path: Path,
) -> None:
    app = start_app("replaced", "layout=1t2r", *WAITING, "loop.total_env_steps=60000",
                    "launcher.rollout_restarts=1")
    app.wait_until("2 updates", lambda: len(rows_so_far(app.run_dir)) >= 2)
    process = app.ranks()[2]
    assert process.name() == "rlcomm-rank2", process.name()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)  # it leaves at the next boundary (its exit: the slot's, below)
    wait_for_members(app, 1)
    joiner = start_joiner(app.run_dir, "joiner")
    wait_for_members(app, 2)
    assert app.wait() == 0, app.describe()
    assert joiner.wait(timeout=60) == 0, (tmp_path / "joiner.out").read_text()[-3000:]
    assert collapse(members_by_update(app.run_dir)) == [2, 1, 2]
    result = read_result(app.run_dir)
    (leave,) = result["leaves"]
    assert (leave["rank"], leave["reason"]) == (2, "asked"), leave
    assert joins_beyond_the_plan(result) == [3], result["joins"]
    # It left: no restart was spent on it, and the launcher saw no loss.
    assert "starting it again" not in app.stderr and "was killed" not in app.stderr, \
        app.describe()
    assert re.search(r"rank 2: asked to stop \(SIGTERM\); it leaves rank 0's group at its next "
                     r"update boundary", app.log(2)), app.log(2)[-3000:]
    assert "rank 0 let it go" in app.log(2)
    app.assert_all_ended()


# The joiner's transitions reach the replay through the trainer that admitted it: its own
# replay (1t1r), or the replay rank it writes its collectors' segments on (issue 60's layout).
OFF_POLICY = {
    "own-replay": ("layout=1t1r", "loop.total_env_steps=40000"),
    "replay-rank": ("layout=replay_server", "layout.world_size=5", "layout.trainers=[0,1]",
                    "layout.replay=[2]", "layout.rollouts=[3,4]", "layout.elastic_rollouts=true",
                    "loop.total_env_steps=75000"),
}


@pytest.mark.parametrize("layout", sorted(OFF_POLICY))
def test_an_off_policy_joiner_feeds_the_replay_of_the_trainer_that_admitted_it(
    start_app: Callable[..., AppProcess], start_joiner: Joiner, tmp_path: Path, layout: str,
) -> None:
    """DQN: the joiner's transitions go to its trainer's replay, as every collector's: every
    env step of the job, the joiner's included, was inserted."""
    app = start_app("dqn-grown", "loop=dqn", *WAITING, *OFF_POLICY[layout])
    app.wait_until("2 updates", lambda: len(rows_so_far(app.run_dir)) >= 2)
    planned = len(read_job_rollouts(app.run_dir))
    joiner = start_joiner(app.run_dir, "joiner")
    wait_for_members(app, planned + 1)
    assert app.wait() == 0, app.describe()
    assert joiner.wait(timeout=60) == 0, (tmp_path / "joiner.out").read_text()[-3000:]
    result = read_result(app.run_dir)
    (join,) = result["joins"]
    rank = join["rank"]
    assert join["reason"] == "beyond the plan" and join["first_trained_s"], join
    reports = {r["rank"]: r for r in result["ranks"]}
    assert reports[rank]["result"]["segments_sent"] > 0
    summary = result["summary"]
    assert summary["replay"]["replay_inserts"] == summary["env_steps"], summary
    app.assert_all_ended()


def test_a_dqn_trainer_joins_beyond_the_plan_and_trains_with_the_others(
    start_app: Callable[..., AppProcess], start_joiner: Joiner, tmp_path: Path,
) -> None:
    """``loop=dqn`` on 2t2r (a replay shard per trainer): the trainer that joins heals from the
    lead and ends with its weights; its shard fills from the segments dealt to it."""
    app = start_app("dqn-trainer", "loop=dqn", "layout=2t2r", *WAITING,
                    "loop.total_env_steps=60000")
    app.wait_until("2 updates", lambda: len(rows_so_far(app.run_dir)) >= 2)
    trainer = start_joiner(app.run_dir, "trainer", "trainer")
    app.wait_until("3 trainers", lambda: column(app.run_dir, "trainers")[-1:] == [3],
                   timeout=JOINER_S)
    assert app.wait() == 0, app.describe()
    assert trainer.wait(timeout=60) == 0, (tmp_path / "trainer.out").read_text()[-3000:]
    result = read_result(app.run_dir)
    assert [(j["rank"], j["reason"]) for j in result["trainer_joins"]] == [(4, "beyond the plan")]
    assert re.search(r"rank 4 \(trainer\) healed from rank 0 at update \d+: \d+ bytes, "
                     r"checksum [0-9a-f]{16} equal on the trainers \[0, 1, 4\]", app.log(0))
    reports = {r["rank"]: r["result"] for r in result["ranks"]}
    assert reports[4]["param_checksum"] == reports[0]["param_checksum"]
    app.assert_all_ended()


def read_job_rollouts(run_dir: Path) -> list[int]:
    return list(json.loads((run_dir / "job.json").read_text())["rollouts"])


def test_app_leave_lets_one_rollout_rank_go_and_refuses_the_lead_in_one_line(
    start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("leave-cli", *RUN)
    app.wait_until("3 updates", lambda: len(rows_so_far(app.run_dir)) >= 3)
    trainer = side_command("app.leave", str(app.run_dir), "rank=0")
    assert trainer.returncode == 2, trainer
    assert trainer.stderr.strip() == (
        "error: rank=0: the lead trainer holds the run's records and decisions and cannot leave; "
        "stop the run instead (SIGTERM to python -m app)"), trainer.stderr
    asked = side_command("app.leave", str(app.run_dir), "rank=2")
    assert asked.returncode == 0, asked
    assert re.fullmatch(r"rank 2 left the job: its trainer let it go from epoch \d+\n",
                        asked.stdout), asked.stdout
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    (leave,) = result["leaves"]
    assert (leave["rank"], leave["reason"]) == (2, "asked"), leave
    assert "rank 0 let it go" in app.log(2)
    assert members_by_update(app.run_dir)[-1] == 2
    assert "rollout ranks: 1 left, 0 joined" in app.stdout, app.describe()
    finished = side_command("app.leave", str(app.run_dir), "rank=1")
    assert finished.returncode == 2, finished
    assert finished.stderr.strip() == (f"error: {app.run_dir}: the run finished (result.json); "
                                       "nothing runs there"), finished.stderr
    app.assert_all_ended()


NO_JOB = "error: {empty}: no running job there (job.json is written once a job with elastic " \
         "ranks runs)"


@pytest.mark.parametrize(("args", "line"), [
    (("app.leave",), "error: usage: python -m app.leave RUN_DIR rank=N"),
    (("app.leave", "{missing}", "rank=1"), "error: {missing}: no such run dir"),
    (("app.leave", "{empty}", "rank=one"), "error: rank=one: a rank number (an integer >= 0)"),
    (("app.leave", "{empty}", "rank=1"), NO_JOB),
    (("app.join", "{empty}"), "error: usage: python -m app.join RUN_DIR "
                              "role=rollout|trainer|replica [loop.threads=N]"),
    (("app.join", "{empty}", "role=learner"), "error: role=learner: one of rollout, trainer, "
                                              "replica"),
    (("app.join", "{missing}", "role=rollout"), "error: {missing}: no such run dir"),
    (("app.join", "{empty}", "role=rollout"), NO_JOB),
])
def test_app_leave_and_app_join_refuse_bad_input_in_one_line(
    tmp_path: Path, args: tuple[str, ...], line: str,
) -> None:
    names = {"missing": str(tmp_path / "missing"), "empty": str(tmp_path)}
    module, *rest = args
    done = side_command(module, *(a.format(**names) for a in rest), timeout=60)
    assert (done.returncode, done.stderr.strip()) == (2, line.format(**names)), done


def write_job_record(run_dir: Path, **changes: Any) -> int:
    """A job.json as a job that is gone left it (its store's port is free); returns the port."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("seed: 0\n")
    from app.launch.jobfile import config_digest, package_version

    record = {"store": {"host": "127.0.0.1", "port": port, "prefix": "rlcomm/0/1/"},
              "world_size": 2, "trainers": [0], "rollouts": [1],
              "shape": {"elastic_rollouts": True}, "timeout_s": 3.0, "pid": 1, "host": "gone",
              "version": package_version(), "config_digest": config_digest(run_dir), **changes}
    (run_dir / "job.json").write_text(json.dumps(record))
    return port


@pytest.mark.parametrize("module", ["app.leave", "app.join"])
def test_a_job_whose_store_is_gone_is_one_line_within_its_timeout(
    tmp_path: Path, module: str,
) -> None:
    """A job.json left by a job that ended without result.json (killed): its store does not
    answer; one line, exit 2, within the job's timeout (3 s here)."""
    port = write_job_record(tmp_path)
    tick = time.monotonic()
    done = side_command(module, str(tmp_path), "rank=1" if module == "app.leave" else "role=rollout",
                        timeout=60)
    assert done.returncode == 2, done
    assert done.stderr.startswith(f"error: {tmp_path}: the job's store at 127.0.0.1:{port} did "
                                  "not answer within 3 s: the job has ended or this host cannot "
                                  "reach it ("), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert time.monotonic() - tick < 40


def test_a_joiner_of_another_version_or_config_or_role_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    for name in "abcd":
        (tmp_path / name).mkdir()
    write_job_record(tmp_path / "a", version="0.0.1")
    write_job_record(tmp_path / "b", config_digest="0123456789abcdef")
    write_job_record(tmp_path / "c")
    static = side_command("app.join", str(tmp_path / "c"), "role=replica", timeout=60)
    assert (static.returncode, static.stderr.strip()) == (2, (
        "error: role=replica: this job's trainers are not elastic "
        "(layout.elastic_trainers=false): none can join while it runs")), static
    write_job_record(tmp_path / "d", shape={"elastic_rollouts": True, "elastic_trainers": True,
                                            "sharded": True, "data_parallel": "fsdp",
                                            "trainer_replicas": 2})
    grouped = side_command("app.join", str(tmp_path / "d"), "role=trainer", timeout=60)
    assert (grouped.returncode, grouped.stderr.strip()) == (2, (
        "error: role=trainer: this job's trainers are sharded in replica groups: they grow by "
        "a whole replica group (role=replica)")), grouped
    from app.launch.jobfile import package_version

    older = side_command("app.join", str(tmp_path / "a"), "role=rollout", timeout=60)
    assert (older.returncode, older.stderr.strip()) == (2, (
        f"error: this is rlcomm {package_version()}, and the job runs rlcomm 0.0.1: a joiner "
        "must run the job's version")), older
    edited = side_command("app.join", str(tmp_path / "b"), "role=rollout", timeout=60)
    assert edited.returncode == 2, edited
    assert re.fullmatch(rf"error: {re.escape(str(tmp_path / 'b' / '.hydra' / 'config.yaml'))} "
                        r"changed since the job started \(digest [0-9a-f]{16}, the job's "
                        r"0123456789abcdef\): a joiner would run another config",
                        edited.stderr.strip()), edited.stderr


@pytest.mark.parametrize(("overrides", "line"), [
    (("launcher.ray.max_rollouts=4",),
     "error: launcher.ray.max_rollouts=4: the Ray engine's (launcher.engine=ray); under "
     "launcher.engine=local, add rollout ranks with python -m app.join"),
    (("launcher.engine=ray", "layout.elastic_rollouts=false", "launcher.ray.max_rollouts=4"),
     "error: launcher.ray.max_rollouts=4: needs elastic rollout ranks "
     "(layout.elastic_rollouts=true, rollout ranks apart from the trainers, on gloo)"),
])
def test_max_rollouts_out_of_place_is_one_line_before_anything_starts(
    tmp_path: Path, overrides: tuple[str, ...], line: str,
) -> None:
    done = side_command("app", *overrides, f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    errors = [text for text in done.stderr.splitlines() if text.startswith("error:")]
    assert (done.returncode, errors) == (2, [line]), done.stderr[-3000:]
    assert not (tmp_path / "run" / "logs").exists()  # no rank started
