"""The Ray engine (``launcher.engine=ray``, app/launch/ray_engine.py) with a real Ray: the
default run on a local Ray; on a 3-node ``ray.cluster_utils.Cluster`` (one per module), the
ranks placed as asked (read back from Ray's placement-group table), a rollout actor or a
trainer actor killed with ``ray.kill`` (left, or replaced and rejoined/healed), a node holding
rollout ranks removed, the driver SIGKILLed and a driver's SIGTERM; the bad inputs. Nothing is
left running."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers.apprun import (
    AppProcess,
    collapse,
    column,
    processes_with_marker,
    read_result,
    rows_so_far,
    run_app,
)

ray = pytest.importorskip("ray", reason="the Ray engine's tests need Ray: pip install -e '.[ray]'")

pytestmark = pytest.mark.e2e

# The default layout (2t2r) and PPO on CartPole, long enough to lose a rank in the middle.
LONG = ("launcher.engine=ray", "loop.progress=false", "loop.total_env_steps=1000000",
        "comm.timeout=60")
NODE_CPUS = 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head and two worker nodes of 2 CPUs each, this test process connected to it."""
    from ray.cluster_utils import Cluster

    made = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS})
    for _ in range(2):
        made.add_node(num_cpus=NODE_CPUS)
    made.wait_for_nodes()
    ray.init(address=made.address, namespace="rlcomm")
    try:
        yield made
    finally:
        ray.shutdown()
        made.shutdown()


def on(cluster: Any, *overrides: str) -> tuple[str, ...]:
    return (*LONG, f"launcher.ray.address={cluster.address}", *overrides)


def placement(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {int(rank): place for rank, place in
            json.loads((run_dir / "placement.json").read_text())["ranks"].items()}


def wait_for_updates(app: AppProcess, updates: int) -> None:
    app.wait_until(f"{updates} updates", lambda: len(rows_so_far(app.run_dir)) >= updates)


def kill_actor(app: AppProcess, rank: int) -> None:
    ray.kill(ray.get_actor(placement(app.run_dir)[rank]["actor"], namespace="rlcomm"),
             no_restart=True)


# A replacement's start on a loaded machine (a new Ray worker, imports) can outlast a run that
# ends when solved: these runs end only when the test stops them, once the replacement is back.
UNTIL_STOPPED = ("loop.target_return=1e9",)


def stop_once_back(app: AppProcess, count: str) -> None:
    """Once ``count`` (a metrics.csv column) went down by the loss and back up by the
    replacement, and one more update was trained, SIGTERM the driver: the run stops at an
    update with its result.json (``stopped_by``)."""
    def back() -> bool:
        counts = column(app.run_dir, count)
        return 1 in counts and counts[-2:] == [2, 2]

    app.wait_until(f"{count} back to 2 after the loss", back)
    app.proc.send_signal(signal.SIGTERM)
    assert app.wait() == 128 + signal.SIGTERM, app.describe()
    assert read_result(app.run_dir)["summary"]["stopped_by"] == "SIGTERM", app.describe()


def rank_processes(app: AppProcess) -> list[psutil.Process]:
    """The run's rank processes: children of the cluster's actors, not of the driver; they
    carry the driver's environment, its test marker included."""
    return [p for p in processes_with_marker(app.marker) if p.name().startswith("rlcomm-rank")]


def test_the_default_run_trains_to_its_target_on_a_local_ray(tmp_path: Path) -> None:
    done = run_app("launcher.engine=ray", f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = read_result(tmp_path / "run")
    assert result["summary"]["solved"], result["summary"]
    assert "solved: mean return" in done.stdout
    assert "(RankActor pid=" not in done.stdout + done.stderr  # the ranks' lines, as locally
    assert re.search(r"^\[rank0\] ppo: mean return", done.stdout + done.stderr, re.MULTILINE)
    placed = placement(tmp_path / "run")
    assert sorted(placed) == [0, 1, 2, 3]
    assert len({p["node_id"] for p in placed.values()}) == 1  # one local Ray node
    timeline = result["timeline"]
    assert timeline["validated"] <= timeline["ray_connected"] <= timeline["placed"]
    # run_app's own check: no process of the run (the local Ray's included) outlived it.


def test_the_ranks_are_placed_as_asked_trainers_packed_rollouts_spread(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("placed", *on(cluster), "loop.total_env_steps=60000")
    wait_for_updates(app, 2)
    placed = placement(app.run_dir)
    # Read back from Ray while the run holds them: each placement group's bundles, and the
    # node each bundle landed on.
    table = ray.util.placement_group_table()
    for rank, place in placed.items():
        group = table[place["placement_group"]]
        role, index = place["bundle"]
        assert group["strategy"] == ("PACK" if role == "trainers" else "SPREAD"), group
        assert group["bundles_to_node_id"][index] == place["node_id"], (rank, group)
        assert role == ("trainers" if rank in (0, 1) else "rollouts")
    assert len({placed[r]["node_id"] for r in (0, 1)}) == 1, placed  # trainers packed
    assert len({placed[r]["node_id"] for r in (2, 3)}) == 2, placed  # rollout ranks spread
    assert app.wait() == 0, app.describe()
    app.assert_all_ended()


def test_a_killed_rollout_actor_leaves_and_the_run_reaches_its_budget(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("rollout-left", *on(cluster), "loop.total_env_steps=150000")
    wait_for_updates(app, 8)
    kill_actor(app, 3)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    assert collapse(column(app.run_dir, "members")) == [2, 1], column(app.run_dir, "members")
    assert [leave["rank"] for leave in result["leaves"]] == [3]
    assert result["joins"] == []
    assert re.search(r"^\[launcher\] rank 3 \(rollout\) lost: its Ray actor died .*; the run "
                     r"goes on without it \(launcher\.rollout_restarts=0\)$", app.stderr,
                     re.MULTILINE), app.describe()
    lead = next(r["result"] for r in result["ranks"] if r["rank"] == 0)
    assert result["summary"]["solved"] or lead["env_steps"] >= 150000, result["summary"]
    app.assert_all_ended()


def test_a_killed_rollout_actor_is_replaced_and_its_replacement_rejoins(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("rollout-replaced", *on(cluster, *UNTIL_STOPPED), "launcher.rollout_restarts=1")
    wait_for_updates(app, 8)
    kill_actor(app, 3)
    stop_once_back(app, "members")
    result = read_result(app.run_dir)
    (join,) = result["joins"]
    assert join["rank"] == 3 and join["reason"] == "admitted", join
    assert [leave["rank"] for leave in result["leaves"]] == [3]
    assert re.search(r"^\[launcher\] rank 3 \(rollout\) lost: its Ray actor died .*; starting a "
                     r"new actor for it \(1 of launcher\.rollout_restarts=1\)$", app.stderr,
                     re.MULTILINE), app.describe()
    assert "joins the running job" in app.log(3)
    app.assert_all_ended()


def test_a_killed_trainer_actor_is_replaced_and_heals_from_a_live_trainer(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("trainer-healed", *on(cluster, *UNTIL_STOPPED), "launcher.trainer_restarts=1")
    wait_for_updates(app, 8)
    kill_actor(app, 1)
    stop_once_back(app, "trainers")
    result = read_result(app.run_dir)
    (join,) = result["trainer_joins"]
    assert join["rank"] == 1, join
    assert re.search(r"rank 1 \(trainer\) healed from rank 0 at update \d+: \d+ bytes, "
                     r"checksum [0-9a-f]{16} equal on the trainers \[0, 1\]", app.log(0))
    lead, healed = (next(r["result"] for r in result["ranks"] if r["rank"] == k) for k in (0, 1))
    assert healed["param_checksum"] == lead["param_checksum"]
    app.assert_all_ended()


def test_with_max_rollouts_the_driver_adds_rollout_actors_as_the_cluster_gains_cpus(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    """3 nodes of 2 CPUs; 1t1r at 2 CPUs a rank takes 4 of the 6: room for one rollout rank
    beyond the plan, then a node added makes room for another, up to
    launcher.ray.max_rollouts=3 (1 planned, 2 grown)."""
    app = start_app("grown", "launcher.engine=ray", f"launcher.ray.address={cluster.address}",
                    "layout=1t1r", "launcher.ray.cpus_per_rank=2", "launcher.ray.max_rollouts=3",
                    "loop.env.id=WaitingCartPole-v1", "loop.target_return=1e9",
                    "loop.total_env_steps=76800", "loop.progress=false", "comm.timeout=60")

    def members() -> list[int]:
        return [int(float(r["members"])) for r in rows_so_far(app.run_dir)] or [0]

    app.wait_until("2 rollout ranks", lambda: members()[-1] == 2)
    node = cluster.add_node(num_cpus=NODE_CPUS)
    try:
        app.wait_until("3 rollout ranks", lambda: members()[-1] == 3)
        assert app.wait() == 0, app.describe()
    finally:
        cluster.remove_node(node)
    result = read_result(app.run_dir)
    assert [(j["rank"], j["reason"]) for j in result["joins"]] == \
        [(2, "beyond the plan"), (3, "beyond the plan")], result["joins"]
    started = re.findall(r"^\[launcher\] the cluster has room for one more rollout rank: "
                         r"starting a Ray actor for it beyond the plan", app.stderr, re.MULTILINE)
    assert len(started) == 2, app.describe()
    assert max(members()) == 3 and "grew to 4 ranks" in app.stdout, app.describe()
    app.assert_all_ended()


def test_a_lost_lead_ends_the_run_in_one_line_and_stops_every_rank(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("lead-lost", *on(cluster))
    wait_for_updates(app, 5)
    kill_actor(app, 0)
    assert app.wait() == 2, app.describe()
    assert re.fullmatch(r"error: rank 0 \(trainer\) failed: its Ray actor died \(\w+: .*\) "
                        r"\(logs: .*/logs\)", app.last_line), app.describe()
    assert not (app.run_dir / "result.json").exists()
    app.assert_all_ended()


def test_a_lost_lead_under_max_restarts_starts_every_rank_again(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("lead-restarted", *on(cluster), "launcher.max_restarts=1",
                    "loop.total_env_steps=150000")
    wait_for_updates(app, 5)
    first = placement(app.run_dir)
    kill_actor(app, 0)
    assert app.wait() == 0, app.describe()
    assert re.search(r"^\[launcher\] rank 0 \(trainer\) failed: its Ray actor died .*; starting "
                     r"every rank again \(1 of launcher\.max_restarts=1\)$", app.stderr,
                     re.MULTILINE), app.describe()
    result = read_result(app.run_dir)
    assert result["summary"]["restarts"] == 1, result["summary"]
    again = placement(app.run_dir)
    assert {p["actor"] for p in again.values()}.isdisjoint(p["actor"] for p in first.values())
    app.assert_all_ended()


def test_a_rank_failing_on_its_own_error_ends_the_run_naming_it(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    """An env that raises on rollout rank 3: a bug, not a lost rank; no replacement would
    fix it, so the run ends, as under the local launcher, whatever the restarts."""
    app = start_app("rank-error", *on(cluster), "launcher.rollout_restarts=1",
                    "loop.env._target_=tests.helpers.failing_env.make_failing_env",
                    "+loop.env.kwargs.fail_rank=3", "+loop.env.kwargs.after_steps=300")
    assert app.wait() == 2, app.describe()
    assert app.last_line.startswith(
        "error: rank 3 (rollout) failed: EnvError: env CartPole-v1 "
        "(tests.helpers.failing_env.make_failing_env) raised RuntimeError: simulated fault "
        "after 300 steps"), app.describe()
    assert "starting a new actor" not in app.stderr
    app.assert_all_ended()


def rollout_only_node(cluster: Any, placed: dict[int, dict[str, Any]]) -> tuple[Any, list[int]]:
    """A worker node (never the head) that holds rollout ranks and no other, and its ranks."""
    for node in sorted(cluster.worker_nodes, key=lambda n: n.node_id):
        ranks = sorted(r for r, p in placed.items() if p["node_id"] == node.node_id)
        if ranks and all(placed[r]["role"] == "rollout" for r in ranks):
            return node, ranks
    raise AssertionError(f"no worker node holds only rollout ranks: {placed}")


def test_a_removed_node_takes_its_rollout_ranks_out_and_the_run_goes_on(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    cluster.add_node(num_cpus=NODE_CPUS)  # the node this test removes, in numbers
    cluster.wait_for_nodes()
    app = start_app("node-lost", *on(cluster), "layout=1t3r", "loop.total_env_steps=200000")
    wait_for_updates(app, 8)
    node, on_node = rollout_only_node(cluster, placement(app.run_dir))
    cluster.remove_node(node)
    assert app.wait() == 0, app.describe()
    result = read_result(app.run_dir)
    assert sorted(leave["rank"] for leave in result["leaves"]) == on_node, result["leaves"]
    assert column(app.run_dir, "members")[-1] == 3 - len(on_node)
    for rank in on_node:
        assert re.search(rf"^\[launcher\] rank {rank} \(rollout\) lost: its Ray actor died",
                         app.stderr, re.MULTILINE), app.describe()
    app.assert_all_ended()


def test_a_replacement_ray_cannot_place_waits_and_the_run_ends_without_it(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    """Every CPU of the cluster taken (4 ranks x 2 CPUs on 4 nodes of 2): a node's loss leaves
    no room for its rank's replacement, which waits; the run goes on without it and, once it
    ended, the driver ends the replacement it could never start."""
    cluster.add_node(num_cpus=NODE_CPUS)
    cluster.wait_for_nodes()
    app = start_app("no-room", *on(cluster), "layout=1t3r", "launcher.ray.cpus_per_rank=2",
                    "launcher.rollout_restarts=1", "loop.total_env_steps=150000")
    wait_for_updates(app, 8)
    node, (rank,) = rollout_only_node(cluster, placement(app.run_dir))
    cluster.remove_node(node)
    assert app.wait() == 0, app.describe()
    assert f"rank {rank} (rollout) lost: its Ray actor died" in app.stderr, app.describe()
    assert "starting a new actor for it (1 of launcher.rollout_restarts=1)" in app.stderr
    # The replacement that never started is among them; on a loaded machine, a finished rank
    # slow to exit may be too (its work is done: the run has succeeded either way).
    stragglers = re.search(r"^\[launcher\] rank\(s\) \[([\d, ]+)\] still running \d+ s after "
                           r"the run ended \(result.json\); ending them$", app.stderr, re.MULTILINE)
    assert stragglers and str(rank) in stragglers[1].split(", "), app.describe()
    result = read_result(app.run_dir)
    assert result["joins"] == [] and [leave["rank"] for leave in result["leaves"]] == [rank]
    app.assert_all_ended()


def test_a_sigkilled_driver_takes_every_actor_with_it_within_10_s(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("driver-killed", *on(cluster))
    wait_for_updates(app, 3)
    ranks = rank_processes(app)
    assert len(ranks) == 4, [p.name() for p in app.processes()]
    names = [p["actor"] for p in placement(app.run_dir).values()]
    app.proc.kill()
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, [p.pid for p in alive]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_actor_alive(n) for n in names):
        time.sleep(0.2)
    assert not any(_actor_alive(n) for n in names)
    app.assert_all_ended()


def test_a_sigkilled_driver_of_a_local_ray_leaves_no_process_behind(
    start_app: Callable[..., AppProcess],
) -> None:
    """A local Ray's node agents would outlive it by a minute, its workers and ranks by
    seconds: the driver's reaper (app/launch/ray_reaper.py) ends them all at once."""
    app = start_app("local-driver-killed", *LONG)
    wait_for_updates(app, 3)
    ranks = rank_processes(app)
    ray_processes = [p for p in processes_with_marker(app.marker)
                     if p.name() in ("raylet", "gcs_server") or p.name().startswith("ray::")]
    assert len(ranks) == 4 and ray_processes, [p.name() for p in app.processes()]
    app.proc.kill()
    app.proc.wait(10)
    _, alive = psutil.wait_procs([*ranks, *ray_processes], timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]
    app.assert_all_ended()


def test_ctrl_c_on_the_terminal_stops_a_local_ray_run_in_one_line(
    start_app: Callable[..., AppProcess],
) -> None:
    """SIGINT to the driver's whole process group, as a terminal's Ctrl-C sends it: the local
    Ray's processes get it too, and the run still ends with the driver's one line."""
    app = start_app("ctrl-c", *LONG)
    wait_for_updates(app, 3)
    os.killpg(app.pid, signal.SIGINT)
    assert app.wait(60) == 128 + signal.SIGINT, app.describe()
    assert app.last_line.startswith("error: interrupted by SIGINT: stopped all 4 ranks"), \
        app.describe()
    app.assert_all_ended()


def _actor_alive(name: str) -> bool:
    try:
        ray.get_actor(name, namespace="rlcomm")
    except ValueError:
        return False
    return True


def test_sigusr1_then_sigterm_to_the_driver_reach_every_rank(
    cluster: Any, start_app: Callable[..., AppProcess],
) -> None:
    app = start_app("driver-stopped", *on(cluster), "launcher.shutdown_timeout=30")
    wait_for_updates(app, 3)
    app.proc.send_signal(signal.SIGUSR1)  # stacks on demand, from every rank, first
    app.wait_until("every rank's stacks", lambda: all(
        "stacks on demand (SIGUSR1)" in app.log(rank) for rank in range(4)), timeout=60)
    assert "SIGUSR1: the ranks write their Python stacks and collectives to" in app.stderr
    app.proc.send_signal(signal.SIGTERM)
    assert app.wait() == 128 + signal.SIGTERM, app.describe()
    assert "interrupted by SIGTERM: stopped all 4 ranks" in app.stderr, app.describe()
    assert "stopped: asked by SIGTERM" in app.log(0)
    assert list((app.run_dir / "checkpoints").glob("ckpt_*.pt")), app.describe()
    app.assert_all_ended()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(("override", "expected"), [
    ("launcher.engine=kubernetes", "launcher.engine"),
    ("launcher.ray.cpus_per_rank=-1", "launcher.ray.cpus_per_rank: must be >= 0, got -1"),
    ("launcher.ray.gpus_per_rank=-0.5", "launcher.ray.gpus_per_rank: must be >= 0, got -0.5"),
    ("launcher.ray.placement_timeout=0", "launcher.ray.placement_timeout: must be a positive"),
    ("launcher.ray.address=nohost", "launcher.ray.address: 'nohost' is not null, auto or"),
    # The port is picked when the test runs: a parameter must read alike on every xdist worker.
    ("launcher.ray.address=127.0.0.1:{free_port}", "no Ray head answers there"),
    ("launcher.ray.cpus_per_rank=4096", "launcher.ray.cpus_per_rank=4096: the local Ray is "
                                         "this machine"),
    ("launcher.ray.max_rollouts=1", "launcher.ray.max_rollouts=1: at least the layout's 2 "
                                    "rollout ranks"),
    ("launcher.ray.max_rollouts=many", "launcher.ray.max_rollouts"),
])
def test_a_bad_ray_setting_is_one_line_and_exit_2(override: str, expected: str,
                                                   tmp_path: Path) -> None:
    override = override.format(free_port=_free_port())
    done = run_app("launcher.engine=ray", override, f"hydra.run.dir={tmp_path / 'run'}",
                   timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], done.stderr[-3000:]
    assert not (tmp_path / "run" / "placement.json").exists()  # no actor was started


def test_ray_not_installed_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    blocker = tmp_path / "noray"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None\n")
    done = run_app("launcher.engine=ray", f"hydra.run.dir={tmp_path / 'run'}",
                   env={"PYTHONPATH": str(blocker)}, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: launcher.engine=ray: Ray is not installed; install it with pip install" \
        in done.stderr, done.stderr[-3000:]


def test_a_rank_asking_more_than_any_node_has_is_one_line(cluster: Any, tmp_path: Path) -> None:
    done = run_app(*on(cluster), "launcher.ray.cpus_per_rank=3",
                   f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert ("error: launcher.ray.cpus_per_rank=3: no node of the Ray cluster has that many "
            "(CPU: 2 on its largest node)") in done.stderr, done.stderr[-3000:]


def test_ranks_the_cluster_cannot_place_end_the_run_after_the_placement_timeout(
    cluster: Any, tmp_path: Path,
) -> None:
    tick = time.monotonic()
    done = run_app(*on(cluster), "layout=1t3r", "launcher.ray.cpus_per_rank=2",
                   "launcher.ray.placement_timeout=3", f"hydra.run.dir={tmp_path / 'run'}",
                   timeout=120)
    assert done.returncode != 0, done.stderr[-3000:]
    assert "could not place the 4 ranks" in done.stderr, done.stderr[-3000:]
    assert "launcher.ray.placement_timeout=3 s" in done.stderr
    assert time.monotonic() - tick < 60
    assert not ray.util.placement_group_table() or all(
        v["state"] == "REMOVED" for v in ray.util.placement_group_table().values())


def test_each_job_of_a_multirun_has_its_own_ray_and_actors(tmp_path: Path) -> None:
    done = run_app("--multirun", "launcher.engine=ray", "loop.total_env_steps=20000",
                   "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    actors = [{p["actor"] for p in placement(tmp_path / "sweep" / str(job)).values()}
              for job in (0, 1)]
    assert all(len(a) == 4 for a in actors) and actors[0].isdisjoint(actors[1]), actors
    for job in (0, 1):
        assert read_result(tmp_path / "sweep" / str(job))["status"] == "ok"


def test_plan_only_under_the_ray_engine_starts_no_ray(tmp_path: Path) -> None:
    done = run_app("launcher.engine=ray", "plan_only=true", f"hydra.run.dir={tmp_path / 'run'}",
                   timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layout picture:" in done.stdout and "TRAIN_DATA_PARALLEL" in done.stdout
    assert not (tmp_path / "run" / "placement.json").exists()
    assert "Ray" not in done.stderr  # no Ray was started, nor connected to
