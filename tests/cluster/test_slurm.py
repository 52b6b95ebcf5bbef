"""The app on a real SLURM cluster: the submitit launcher presets, plain srun/sbatch, failures.

A session fixture starts the local single-node cluster (tests/slurm/cluster_up.sh, needs root)
and stops it at the end (cluster_down.sh), then checks that none of its daemons survived. Without
root, the tests use a SLURM that already answers (``sinfo``), or skip. Every test runs in fresh
folders: job ids restart when the cluster's state is wiped. Which task is a rank, without a
cluster, is tests/unit/test_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.helpers.apprun import (
    MARKER,
    REPO,
    assert_commcheck_passed,
    assert_no_survivors,
    describe,
    read_result,
    run_app,
)

SCRIPTS = REPO / "tests" / "slurm"
STATE = Path(os.environ.get("RLCOMM_SLURM_STATE", "/var/lib/rlcomm-slurm"))
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
FAST_COMMCHECK = ("loop=commcheck", "loop.latency_iters=3", "loop.bandwidth_bytes=65536",
                  "loop.bandwidth_iters=1", "comm.timeout=60")


@dataclass(frozen=True)
class Cluster:
    partition: str


def _daemon_pids() -> dict[str, int]:
    """Our daemons that run now, by the pids cluster_up.sh recorded (never by name)."""
    found = {}
    for name in DAEMONS:
        try:
            pid = int((STATE / "pids" / f"{name}.pid").read_text())
            exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
        except (OSError, ValueError):
            continue
        if Path(exe).name == name or exe == os.path.realpath(f"/usr/sbin/{name}"):
            found[name] = pid
    return found


def _sinfo_partition() -> str | None:
    if not shutil.which("sinfo"):
        return None
    proc = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=20)
    names = proc.stdout.split()
    if proc.returncode != 0 or not names:
        return None
    default = [n for n in names if n.endswith("*")]
    return os.environ.get("RLCOMM_SLURM_PARTITION") or (default or names)[0].rstrip("*")


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        partition = _sinfo_partition()
        if partition is None:
            pytest.skip("needs root to start the local SLURM cluster (tests/slurm/cluster_up.sh), "
                        "or a running SLURM cluster (sinfo answers)")
        yield Cluster(partition)  # not ours: leave it running
        return
    was_up = set(_daemon_pids()) == set(DAEMONS)
    up = subprocess.run(["bash", str(SCRIPTS / "cluster_up.sh")], capture_output=True, text=True,
                        timeout=600)
    assert up.returncode == 0, f"cluster_up.sh failed:\n{up.stderr[-3000:]}"
    daemons = _daemon_pids()
    try:
        yield Cluster(up.stdout.strip().splitlines()[-1])
    finally:
        if not was_up:  # a cluster someone else started stays up
            down = subprocess.run(["bash", str(SCRIPTS / "cluster_down.sh")], capture_output=True,
                                  text=True, timeout=300)
            assert down.returncode == 0, f"cluster_down.sh failed:\n{down.stderr[-3000:]}"
            left = {n: p for n, p in daemons.items() if psutil.pid_exists(p)
                    and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
            assert not left, f"daemons left running: {left}"
            assert not _daemon_pids()


def sacct_states(job_ids: list[str], expected: str, timeout: float = 30) -> dict[str, str]:
    """Poll sacct (it lags a job's end by about a second) until every job has left the queue."""
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
                              capture_output=True, text=True, timeout=30)
        states = dict(line.split("|", 1) for line in proc.stdout.split() if "|" in line)
        states = {j: s for j, s in states.items() if j in job_ids}
        if len(states) == len(job_ids) and all(s == expected for s in states.values()):
            return states
        if time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def array_jobs(sweep_dir: Path) -> list[str]:
    """The SLURM ids (``<array>_<index>``) of a sweep's jobs, from submitit's folders."""
    return sorted(p.name for p in (sweep_dir / ".submitit").iterdir()
                  if re.fullmatch(r"\d+_\d+", p.name))


def rank_logs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "logs").glob("rank*.log"))


def launcher(cluster: Cluster, preset: str) -> tuple[str, ...]:
    args: tuple[str, ...] = (f"hydra/launcher={preset}", "hydra.launcher.timeout_min=5")
    if preset == "rlcomm_slurm":
        # 1 CPU per rank: both 4-rank jobs of an array fit the 8-CPU node at once (and must not
        # share a rendezvous port)
        args += (f"hydra.launcher.partition={cluster.partition}", "hydra.launcher.cpus_per_task=1")
    return args


# --------------------------------------------------------------------------------------------
# Sweeps through the launcher presets
# --------------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_multirun_over_two_layouts_leaves_one_result_per_job(
    cluster: Cluster, tmp_path: Path
) -> None:
    # The local preset's multirun of two layouts: tests/e2e/test_sweeps.py's
    # test_a_two_node_layout_through_the_local_submitit_launcher_simulates_its_nodes.
    sweep = tmp_path / "sweep"
    proc = run_app("--multirun", *launcher(cluster, "rlcomm_slurm"), "layout=2t2r,1t3r",
                   *FAST_COMMCHECK, f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, describe(proc)
    for job in ("0", "1"):
        assert_commcheck_passed(read_result(sweep / job), 4)
        assert rank_logs(sweep / job) == [f"rank{r}.log" for r in range(4)]
    summary = json.loads((sweep / "summary.json").read_text())
    assert [(j["job"], j["status"]) for j in summary["jobs"]] == [(0, "ok"), (1, "ok")]
    # Ranked after the sweep, in the submitting process (commcheck's default metric).
    assert summary["rank_by"] == "max_latency_us" and len(summary["ranking"]) == 2
    assert (sweep / "summary.md").read_text().strip() in proc.stdout
    ids = array_jobs(sweep)
    assert len(ids) == 2 and len({i.split("_")[0] for i in ids}) == 1  # one job array
    assert sacct_states(ids, "COMPLETED") == dict.fromkeys(ids, "COMPLETED")
    assert "[1 node(s) x 4 task(s)]" in proc.stderr + proc.stdout


CRASH_LOOP = '''
import time
from dataclasses import dataclass


@dataclass
class CrashOn:
    """Raises on one rank; the others wait for it as if in a collective, forever."""

    rank: int = 1

    def __call__(self, ctx, job):
        if job.rank == self.rank:
            raise ValueError(f"boom on rank {job.rank}")
        time.sleep(3600)
        return {}
'''


@pytest.mark.cluster
def test_a_crashing_rank_fails_the_multirun_promptly_and_is_named(
    cluster: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "crashpkg").mkdir()
    (tmp_path / "crashpkg" / "__init__.py").write_text("")
    (tmp_path / "crashpkg" / "loops.py").write_text(textwrap.dedent(CRASH_LOOP))
    (tmp_path / "conf" / "loop").mkdir(parents=True)
    (tmp_path / "conf" / "loop" / "crash.yaml").write_text("_target_: crashpkg.loops.CrashOn\n")
    sweep = tmp_path / "sweep"
    start = time.monotonic()
    proc = run_app("--multirun", *launcher(cluster, "rlcomm_slurm"), "layout=1t1r", "loop=crash",
                   f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "comm.timeout=30",
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path, env={"PYTHONPATH": f"{REPO}:{tmp_path}"},
                   timeout=240)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, describe(proc)
    assert elapsed < 120, f"took {elapsed:.0f} s: the other ranks were not stopped"
    assert "rank 1: ValueError: boom on rank 1" in proc.stderr, describe(proc)
    assert "rank 0 ended without reporting" in proc.stderr
    assert "cancelling" not in proc.stderr  # srun --kill-on-bad-exit stopped them, not the launcher
    ids = array_jobs(sweep)
    assert sacct_states(ids, "FAILED") == dict.fromkeys(ids, "FAILED")
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["jobs"][0]["status"] == "failed"
    assert "rank 1: ValueError: boom on rank 1" in summary["jobs"][0]["error"]


@pytest.mark.cluster
def test_a_layout_of_another_world_size_fails_every_task_before_any_group(
    cluster: Cluster, tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    # 2 tasks, not 4: the same error at half the cost (every task imports torch first)
    proc = run_app("--multirun", *launcher(cluster, "rlcomm_slurm"), "hydra.launcher.tasks_per_node=2",
                   "layout=2t2r", *FAST_COMMCHECK, f"hydra.sweep.dir={sweep}", cwd=tmp_path,
                   timeout=180)
    assert proc.returncode != 0
    # Each task refuses on its own; srun --kill-on-bad-exit=1 ends the step when the first one
    # exits, so the other may be killed before it reports (docs/clusters.md).
    refused = re.search(r"(ranks \[0, 1\]|rank [01]): ConfigError: layout\.world_size: 4 but "
                        r"this job has 2 ranks", proc.stderr)
    assert refused, describe(proc)
    if refused.group(1) != "ranks [0, 1]":
        other = "rank 1" if refused.group(1) == "rank 0" else "rank 0"
        assert f"{other} ended without reporting (stopped or killed" in proc.stderr, describe(proc)
    ids = array_jobs(sweep)
    assert sacct_states(ids, "FAILED") == dict.fromkeys(ids, "FAILED")
    for log in (sweep / "0" / "logs").glob("rank*.log"):
        assert "groups:" not in log.read_text()  # failed before creating any group


# --------------------------------------------------------------------------------------------
# Plain sbatch + srun
# --------------------------------------------------------------------------------------------


def sbatch_example(
    cluster: Cluster, tmp_path: Path, *overrides: str, sbatch_args: tuple[str, ...] = ()
) -> tuple[str, str, str]:
    """Submit examples/slurm_commcheck.sbatch; returns (job id, final state, job output).

    Polls sacct rather than ``sbatch --wait``, which checks the job 2, 10 and 42 s after it starts.
    """
    marker = uuid.uuid4().hex
    env = job_env(marker)
    out = tmp_path / "slurm.out"
    try:
        job = submit(cluster, tmp_path, REPO / "examples" / "slurm_commcheck.sbatch", overrides,
                     env, sbatch_args)
        state = wait_for_job(job, timeout=180)
    finally:
        assert_no_survivors(marker)
    return job, state, out.read_text() if out.exists() else ""


def job_env(marker: str) -> dict[str, str]:
    """A job's environment: this one, the test's marker (no survivor escapes), the checkout."""
    return {**os.environ, MARKER: marker, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}


def submit(cluster: Cluster, tmp_path: Path, script: Path, overrides: tuple[str, ...],
           env: dict[str, str], sbatch_args: tuple[str, ...] = ()) -> str:
    """``sbatch`` of ``script`` with ``overrides``, run in ``tmp_path`` with its output in
    ``tmp_path/slurm.out``; the job id."""
    proc = subprocess.run(
        ["sbatch", "--parsable", *sbatch_args, "-p", cluster.partition, "-o",
         str(tmp_path / "slurm.out"), "--chdir", str(tmp_path), str(script), *overrides],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, describe(proc)
    return proc.stdout.strip().split(";")[0]


def wait_for_job(job: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job],
                              capture_output=True, text=True, timeout=30)
        state = proc.stdout.strip().split(" ")[0] if proc.stdout.strip() else "UNKNOWN"
        if state not in ("UNKNOWN", "PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED"):
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job], check=False)
    raise AssertionError(f"job {job} still {state} after {timeout} s")


@pytest.mark.cluster
def test_srun_in_sbatch_makes_each_task_a_rank_with_one_run_dir(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, state, out = sbatch_example(cluster, tmp_path, "layout=1t3r", *FAST_COMMCHECK[1:])
    assert state == "COMPLETED", out
    # every rank resolved the same run dir on its own, named after the job step
    assert [p.name for p in (tmp_path / "outputs" / "runs").iterdir()] == [f"slurm-{job}.0"]
    run_dir = tmp_path / "outputs" / "runs" / f"slurm-{job}.0"
    assert_commcheck_passed(read_result(run_dir), 4)
    assert rank_logs(run_dir) == [f"rank{r}.log" for r in range(4)]


@pytest.mark.cluster
def test_srun_with_a_layout_of_another_world_size_fails_clearly(
    cluster: Cluster, tmp_path: Path
) -> None:
    _, state, out = sbatch_example(cluster, tmp_path, "layout=2t2r", sbatch_args=("--ntasks-per-node=2",))
    assert state == "FAILED", out
    # Each task refuses on its own; srun --kill-on-bad-exit=1 ends the step when the first one
    # exits, so the other may be killed before it prints its line.
    ranks = re.findall(r"error: layout\.world_size: 4 but this job has 2 ranks \(rank (\d)\)", out)
    assert ranks and set(ranks) <= {"0", "1"}, out
    assert "groups:" not in out


# --------------------------------------------------------------------------------------------
# A requeued job continues its own run dir (the run dir's lock: app/launch/rundir.py)
# --------------------------------------------------------------------------------------------

REQUEUE_SCRIPT = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
srun --kill-on-bad-exit=1 "$PYTHON" -m app "$@"
"""


@pytest.mark.cluster
def test_a_requeued_job_resumes_its_own_run_dir_from_its_newest_checkpoint(
    cluster: Cluster, tmp_path: Path
) -> None:
    """``scontrol requeue`` mid-run: the job runs again under its id, rank 0 finds the stale lock
    of its own run in ``slurm-<job>.0`` and continues there, and every rank resumes from the
    newest checkpoint (SLURM_RESTART_COUNT counts as a restart)."""
    updates = 60
    script = tmp_path / "requeue.sbatch"
    script.write_text(REQUEUE_SCRIPT)
    marker = uuid.uuid4().hex
    env = job_env(marker)
    out = tmp_path / "slurm.out"
    overrides = ("layout=1t1r", "loop.hparams={num_envs:4,num_steps:64}", "loop.progress=false",
                 "loop.target_return=1e9", "loop.checkpoint_every=2",
                 f"loop.total_env_steps={updates * 256}", "comm.timeout=60")
    job = ""
    try:
        job = submit(cluster, tmp_path, script, overrides, env)
        run_dir = tmp_path / "outputs" / "runs" / f"slurm-{job}.0"
        deadline = time.monotonic() + 180
        while not list((run_dir / "checkpoints").glob("ckpt_*.pt")):
            assert time.monotonic() < deadline, f"no checkpoint after 180 s\n{_read(out)}"
            time.sleep(0.2)
        assert not (run_dir / "result.json").exists(), "the run ended before the requeue"
        requeue = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                                 timeout=30, check=False)
        assert requeue.returncode == 0, describe(requeue)
        _start_requeued_now(job)
        # sacct may still show the first attempt's end (FAILED) for a while: the queue says
        # when the second one ended, then sacct (polled) how.
        deadline = time.monotonic() + 400
        while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True,
                             timeout=30).stdout.strip():
            assert time.monotonic() < deadline, f"job {job} still queued\n{_read(out)}"
            time.sleep(0.5)
        state = sacct_states([job], "COMPLETED").get(job, "UNKNOWN")
    finally:
        if job:
            subprocess.run(["scancel", job], check=False, timeout=30)
        assert_no_survivors(marker)
    output = _read(out)
    assert state == "COMPLETED", output
    assert [p.name for p in (tmp_path / "outputs" / "runs").iterdir()] == [f"slurm-{job}.0"]
    assert re.search(rf"hydra\.run\.dir: continuing {run_dir} of run slurm-{job}\.0 \(stale lock "
                     r"of pid \d+ on \S+ since .* \(run slurm-", output), output
    result = read_result(run_dir)
    assert {r["rank"]: r["result"]["updates"] for r in result["ranks"]} == {0: updates,
                                                                           1: updates}
    assert result["summary"]["restarts"] == 1, result["summary"]
    resumed = {r: re.findall(r"resumed from \S+ckpt_(\d+)\.pt at update (\d+)",
                             (run_dir / "logs" / f"rank{r}.log").read_text()) for r in range(2)}
    (name, at), = resumed[0]
    assert resumed[1] == [(name, at)] and 2 <= int(at) < updates and int(name) == int(at), resumed


def _start_requeued_now(job: str, timeout: float = 120) -> None:
    """Until the requeued job runs again. It waits about two minutes (reason BeginTime) before
    it may start: it is made eligible sooner. Not at once: slurmd refuses to launch a job whose
    credential dates from the second its earlier one was revoked in ("Job credential revoked")."""
    time.sleep(3)
    deadline = time.monotonic() + timeout
    pending = False
    while time.monotonic() < deadline:
        proc = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T|%r"], capture_output=True,
                              text=True, timeout=30)
        state, _, reason = proc.stdout.strip().partition("|")
        if state == "PENDING":
            if reason == "BeginTime" and not pending:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                               capture_output=True, timeout=30, check=False)
            pending = True
        elif pending and state != "PENDING":
            return  # running (or already done) again
        time.sleep(0.2)
    raise AssertionError(f"job {job} did not start again within {timeout:.0f} s of its requeue")


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


# --------------------------------------------------------------------------------------------
# A job that grows: a new srun step runs python -m app.join (docs/growth.md)
# --------------------------------------------------------------------------------------------

# The job that grows: 1t1r on the waiting CartPole, long enough for a joiner to come.
GROWN = ("layout=1t1r", "loop.env.id=WaitingCartPole-v1", "loop.progress=false",
         "loop.target_return=1e9", "loop.total_env_steps=30720", "comm.timeout=60")

GROW_SCRIPT = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks=3
#SBATCH --cpus-per-task=1
set -euo pipefail
RUN_DIR="$PWD/outputs/runs/slurm-$SLURM_JOB_ID.0"
srun -n2 --kill-on-bad-exit=1 "$PYTHON" -m app "$@" &
for _ in $(seq 600); do
    [ -f "$RUN_DIR/metrics.csv" ] && [ "$(wc -l < "$RUN_DIR/metrics.csv")" -ge 3 ] && break
    sleep 0.2
done
srun -n1 --overlap "$PYTHON" -m app.join "$RUN_DIR" role=rollout
wait
"""


@pytest.mark.cluster
def test_an_srun_step_running_app_join_grows_the_job_of_another_step(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Step 0 runs the job (1t1r, 2 tasks); once it trains, step 1 runs ``python -m app.join``:
    its rollout rank joins beyond the plan and ends with the job, which completes."""
    script = tmp_path / "grow.sbatch"
    script.write_text(GROW_SCRIPT)
    marker = uuid.uuid4().hex
    env = job_env(marker)
    out = tmp_path / "slurm.out"
    try:
        job = submit(cluster, tmp_path, script, GROWN, env)
        state = wait_for_job(job, timeout=300)
    finally:
        assert_no_survivors(marker)
    text = out.read_text() if out.exists() else ""
    assert state == "COMPLETED", text[-4000:]
    result = read_result(tmp_path / "outputs" / "runs" / f"slurm-{job}.0")
    (join,) = result["joins"]
    assert (join["rank"], join["reason"]) == (2, "beyond the plan"), join
    assert join["first_trained_s"] is not None, join
    assert "rollout ranks: 0 left, 1 joined, grew to 3 ranks" in text, text[-4000:]


JOB_SCRIPT = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
set -euo pipefail
srun -n2 --kill-on-bad-exit=1 "$PYTHON" -m app "$@"
"""

JOINER_SCRIPT = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
set -euo pipefail
srun -n1 "$PYTHON" -m app.join "$@"
"""


@pytest.mark.cluster
def test_another_sbatch_job_running_app_join_grows_the_job(cluster: Cluster, tmp_path: Path) -> None:
    """Job A runs the job (1t1r, 2 tasks); once it trains, job B, an sbatch job of its own, runs
    ``python -m app.join A's run dir role=rollout`` where it reaches A's store: its rollout rank
    joins beyond the plan, both jobs complete."""
    (tmp_path / "job.sbatch").write_text(JOB_SCRIPT)
    joiner_dir = tmp_path / "joiner"
    joiner_dir.mkdir()
    (joiner_dir / "join.sbatch").write_text(JOINER_SCRIPT)
    marker = uuid.uuid4().hex
    env = job_env(marker)
    try:
        job = submit(cluster, tmp_path, tmp_path / "job.sbatch", GROWN, env)
        run_dir = tmp_path / "outputs" / "runs" / f"slurm-{job}.0"
        deadline = time.monotonic() + 240
        while len(_read(run_dir / "metrics.csv").splitlines()) < 3:
            assert time.monotonic() < deadline, _read(tmp_path / "slurm.out")[-4000:]
            time.sleep(0.2)
        joiner = submit(cluster, joiner_dir, joiner_dir / "join.sbatch",
                        (str(run_dir), "role=rollout"), env)
        states = (wait_for_job(job, timeout=300), wait_for_job(joiner, timeout=120))
    finally:
        assert_no_survivors(marker)
    text, joined = _read(tmp_path / "slurm.out"), _read(joiner_dir / "slurm.out")
    assert states == ("COMPLETED", "COMPLETED"), (text[-3000:], joined[-3000:])
    (join,) = read_result(run_dir)["joins"]
    assert (join["rank"], join["reason"]) == (2, "beyond the plan"), join
    assert "rank 2 (rollout, beyond the plan of 2) asks rank 0 to admit it" in joined, joined
    assert "rollout ranks: 0 left, 1 joined, grew to 3 ranks" in text, text[-4000:]
