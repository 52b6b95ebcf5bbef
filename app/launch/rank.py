"""What every rank runs: init the context, create the planned groups, run the loop, report."""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from app.api import JobInfo, Loop, LoopHooks, RankEnv
from app.errors import naming
from app.launch.environment import job_start_time, resolve_rank_env
from app.launch.failures import recording_failures
from app.launch.jobfile import write_job_record
from app.launch.lifeline import tie_to_launcher
from app.launch.planning import ValidatedJob, check_world_size
from app.output import timeline
from app.output.background import wait_for_background
from app.output.logs import FILE_ONLY
from app.output.summary import run_summary
from app.output.trackers import close_trackers, finish_trackers
from rlcomm import CommContext, CommMode, LayoutPlan, collectives
from rlcomm.elastic import BEYOND_PLAN, mark_running
from rlcomm.errors import MembersLostError, PeerLostError
from rlcomm.net.gloo_words import gist
from rlcomm.net.hosts import Hosts, agree_on_hosts, announce_lost, lost_hosts

log = logging.getLogger(__name__)

_SPACES_KEY = "app/probed_spaces"  # the env's spaces rank 0 probed (_share_probed_spaces)


@record
def run_rank(
    job: ValidatedJob, plan: LayoutPlan, run_dir: str, launched_here: bool = False,
) -> dict[str, Any] | None:
    """One rank, from environment to result; returns the run summary on rank 0.

    ``job`` and ``plan`` were validated by the process that launched this rank (or, for a rank
    started by torchrun or SLURM, by this process before it came here): neither is validated
    again, ``job.loop`` is the loop validation built and ``job.shape`` the run's shape it
    derived (app/launch/planning.py), which the loop gets as it is (``JobInfo.shape``).
    ``launched_here``: started by the app's local launcher, every rank on this machine on
    purpose (a layout's nodes are then simulated, as under submitit's local executor); otherwise
    a launcher placed the ranks on hosts, and the layout's nodes must match them.
    """
    from app.output.logs import setup_rank_logging

    # First: a launcher SIGKILLed from here on takes this rank with it (app/launch/lifeline.py).
    tie_to_launcher(launched_here)
    timeline.reset()  # a forked rank starts with the forkserver's (none) or a sweep job's marks
    timeline.mark("started")
    # Until the watchdog listens (after init), `kill -USR1` must not end the rank.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    env = resolve_rank_env()
    os.environ.update(env.torch_variables())
    # torch and the app are imported: move those objects out of the collector's way, so a full
    # collection does not land in the middle of creating thousands of groups.
    gc.freeze()
    setup_rank_logging(Path(run_dir), env.rank)
    try:
        with recording_failures(Path(run_dir) / "logs", env.rank, env.restart_count, env.node):
            return _run(job, plan, env, Path(run_dir), launched_here)
    except BaseException:
        # The traceback lands in this rank's log file; the console gets the launcher's error line.
        log.exception("rank %d failed", env.rank, extra=FILE_ONLY)
        close_trackers(failed=True)  # rank 0's tracker runs, marked failed where they can be
        raise


def oversubscribed(threads: int, ranks_here: int, cores: int) -> str | None:
    """A warning when ``loop.threads`` per rank, over the ranks on this host, asks for more
    threads than it has cores: intra-op threads that wait spin, and the ranks then slow each
    other down (docs/mujoco.md measured PPO on Hopper 5x slower); None when they fit, or when
    ``threads`` is 0 (the launcher's share: cores over ranks)."""
    if not threads or threads * ranks_here <= cores:
        return None
    ranks = f"{ranks_here} rank{'s' if ranks_here > 1 else ''}"
    return (f"loop.threads={threads} x {ranks} on this host = {threads * ranks_here} threads on "
            f"{cores} cores: they will slow each other down; loop.threads=0 gives each rank "
            f"its share ({max(1, cores // ranks_here)})")


def _run(
    cfg: ValidatedJob, plan: LayoutPlan, env: RankEnv, run_dir: Path, launched_here: bool,
) -> dict[str, Any] | None:
    """The rank's steps: init, host agreement and groups, the loop, the reports, the summary."""
    check_world_size(plan, env.world_size, env.rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    crowded = oversubscribed(LoopHooks(cfg.loop).threads, env.local_world_size,
                             os.cpu_count() or 1)
    if crowded and env.local_rank == 0:
        log.warning("%s", crowded)
    ctx = _init(cfg, plan, env)
    if not launched_here:  # this process validated the config itself: without probing, but rank 0
        _share_probed_spaces(ctx, cfg.loop, env.rank)
    if ctx.joined_running_job:  # a replacement rollout rank (rlcomm.elastic)
        _join_running_job(cfg, plan, env, run_dir, ctx)
        return None
    if ctx.watchdog is not None:  # `kill -USR1`: stacks and collective table to the log
        ctx.watchdog.dump_on(signal.SIGUSR1)
    startup_s = time.time() - job_start_time()
    tick = time.perf_counter()
    one_machine = launched_here or env.launcher == "submitit"  # both start every rank here
    plan, hosts = _agree_and_create_groups(ctx, plan, env, one_machine)
    if plan.elastic_modes and env.rank == 0:  # python -m app.leave and app.join reach it so
        write_job_record(run_dir, plan, cfg.shape, float(cfg.comm.timeout))
    group_creation_s = time.perf_counter() - tick
    timeline.mark("groups")
    log.info("rank %d (%s) groups: %s", env.rank, plan.role(env.rank), sorted(ctx.describe()))
    _seed_everything(cfg.seed + env.rank)
    loop: Loop = cfg.loop
    timeline.mark("loop")
    result = _run_loop(loop, ctx, cfg, plan, env, run_dir, hosts, launched_here)
    timeline.mark("finished")
    reports = _gather_reports(ctx, cfg, plan, hosts, env.rank, result)
    # What the loop handed off at its stop decision (the learning curve,
    # app/output/background.py) is written before this rank reports success.
    wait_for_background(float(cfg.comm.timeout))
    if reports is None:
        close_trackers(failed=False)  # none but on rank 0, which has the reports
        return None
    summary = _summary(cfg, plan, env, run_dir, loop, result, reports,
                       {"startup_s": round(startup_s, 3),
                        "group_creation_s": round(group_creation_s, 3)})
    # The trackers get the summary's figures and files (every file written by now), then end:
    # before result.json, so that a run that reports success has them all.
    finish_trackers(summary["summary"])
    _write_result(run_dir / "result.json", json.dumps(summary, indent=2))
    # The launcher prints the closing summary (app.output.summary.format_summary) once the ranks end.
    done = "succeeded" if summary["status"] == "ok" else "stopped when asked"
    log.info("all %d ranks %s; summary in %s", plan.world_size, done, run_dir / "result.json",
             extra=FILE_ONLY)
    return summary


def _init(cfg: ValidatedJob, plan: LayoutPlan, env: RankEnv) -> CommContext:
    """The distributed context of this rank: the default group, the store, the watchdog."""
    ctx = CommContext()
    ctx.init_distributed_env(
        backend=cfg.comm.backend,
        dist_url=cfg.comm.init_method,
        # Seconds, fractions kept: init_distributed_env keeps the int annotation of CommContext's
        # published API (tests/unit/test_names.py), and the timedelta it builds takes a float.
        timeout=cfg.comm.timeout,  # type: ignore[arg-type]
        hang_timeout=cfg.comm.hang_timeout,
        debug=cfg.comm.debug,
        record=cfg.comm.record,
        elastic_member=plan.is_elastic_rank(env.rank),
    )
    return ctx


def _share_probed_spaces(ctx: CommContext, loop: Loop, rank: int) -> None:
    """The env's spaces rank 0 probed, on every rank of a joined run, so that no other rank
    builds an env to learn them (a trainer then builds none at all). Rank 0 leaves them in the
    rendezvous store, as data (app/runtime/envs/spaces_wire.py), for the others and for a rank that
    joins later; a loop without spaces, or spaces with no data form, leave each rank to probe."""
    from app.runtime.envs.spaces_wire import decode_spaces, encode_spaces

    if rank == 0:
        probed = vars(loop).get("spaces")  # RLLoop.spaces, cached by validation
        encoded = encode_spaces(probed) if probed is not None else None
        ctx.store.set(_SPACES_KEY, encoded or b"")  # type: ignore[arg-type]  # bytes: fine
        return
    encoded = ctx.store.get(_SPACES_KEY)  # written by rank 0 of this run
    if encoded:
        vars(loop)["spaces"] = decode_spaces(encoded)  # what RLLoop.spaces would probe


def _agree_and_create_groups(
    ctx: CommContext, plan: LayoutPlan, env: RankEnv, one_machine: bool
) -> tuple[LayoutPlan, Hosts]:
    """Every rank learns every rank's host (``one_machine``: the layout's nodes are simulated),
    then creates the planned groups; returns the plan as the hosts place it, and the hosts."""
    plan, hosts = agree_on_hosts(ctx, plan, simulated_nodes=one_machine)
    ctx.init_groups(plan)
    if plan.elastic_modes and env.rank == 0:
        mark_running(ctx.store)  # a process starting as a rank from now on joins
    return plan, hosts


def _run_loop(
    loop: Loop, ctx: CommContext, cfg: ValidatedJob, plan: LayoutPlan, env: RankEnv,
    run_dir: Path, hosts: Hosts, launched_here: bool,
) -> Any:
    """The loop's result; an error that a lost host explains names that host. Started by the
    app's local launcher, a lost rollout rank comes back only through its restarts."""
    try:
        return loop(ctx, JobInfo(plan=plan, run_dir=run_dir, seed=cfg.seed, rank=env.rank,
                                 env=env, shape=cfg.shape, hosts=dict(enumerate(hosts.names)),
                                 rollout_restarts=(cfg.launcher.rollout_restarts
                                                   if launched_here else None),
                                 trainer_restarts=(cfg.launcher.trainer_restarts
                                                   if launched_here else None),
                                 stop_grace_s=float(cfg.launcher.shutdown_timeout)))
    except MembersLostError:
        raise  # its own line names who was lost
    except Exception as err:
        _raise_if_hosts_lost(ctx, hosts, env.rank, err)
        raise


def _raise_if_hosts_lost(ctx: CommContext, hosts: Hosts, rank: int, err: Exception) -> None:
    """Lost-host diagnosis: when ``err`` came from hosts that are gone, tell the other ranks
    and raise a PeerLostError that names them; else return (``err`` is this rank's own)."""
    lost = lost_hosts(ctx, hosts, err)
    if lost is None:
        return
    announce_lost(ctx, hosts, lost)
    raise PeerLostError(
        f"rank {rank} on {hosts.names[rank]}: lost {hosts.describe(lost)}: {gist(err)}"
    ) from err


def _gather_reports(
    ctx: CommContext, cfg: ValidatedJob, plan: LayoutPlan, hosts: Hosts, rank: int, result: Any
) -> list[dict[str, Any]] | None:
    """Every rank's report, on rank 0 (None elsewhere); the context is destroyed after."""
    report = {
        "rank": rank,
        "role": plan.role(rank),
        "host": hosts.names[rank],
        "pid": os.getpid(),
        "groups": {mode: info.__dict__ for mode, info in ctx.describe().items()},
        "result": result,
        "timeline": timeline.marks(),
    }
    if plan.elastic_modes:  # rollout ranks came and went: no group spans every rank now
        reports = _reports_through_store(ctx, plan, report, float(cfg.comm.timeout), cfg.loop)
        ctx.destroy(barrier=False)
    else:
        reports = collectives.gather_json(ctx, CommMode.GLOBAL, report, dst=0)
        ctx.destroy()
    return reports


def _summary(
    cfg: ValidatedJob, plan: LayoutPlan, env: RankEnv, run_dir: Path, loop: Loop, result: Any,
    reports: list[dict[str, Any]], startup: dict[str, float],
) -> dict[str, Any]:
    """Rank 0's ``result.json``: the loop's figures, every rank's report, the timeline."""
    wall_s = time.time() - job_start_time()
    # A run asked to stop (SIGTERM: app/runtime/core/stopping.py) ended where its ranks agreed, with
    # a checkpoint, but short of its own end.
    stopped = isinstance(result, dict) and result.get("stopped_by")
    summary = {
        "status": "stopped" if stopped else "ok",
        "world_size": plan.world_size,
        "loop": loop_name(loop),
        # The figures a sweep compares (app/metrics.py): the loop's, as rank 0 reports them.
        "metrics": {
            **((result.get("metrics") or {}) if isinstance(result, dict) else {}),
            **startup,
            "wall_s": round(wall_s, 2),
        },
        "summary": run_summary(
            loop_name(loop),
            plan.world_size,
            restarts=env.restart_count,
            wall_s=wall_s,
            run_dir=run_dir,
            loop_summary=LoopHooks(loop).summary(result, run_dir),  # the loop's figures and files
        ),
        "ranks": reports,
    }
    # When each step was reached (app/output/timeline.py): the launcher's marks, each rank's.
    run_timeline: dict[str, Any] = {
        **timeline.launcher_marks(),
        "ranks": {str(r["rank"]): r.pop("timeline", {}) for r in reports},
        "result": time.time(),
    }
    summary["timeline"] = run_timeline
    if plan.elastic_modes:  # every join and leave, from the trainers that saw them
        _add_membership_changes(summary, reports)
    summary["phases"] = timeline.phases(run_timeline)
    return summary


def _add_membership_changes(summary: dict[str, Any], reports: list[dict[str, Any]]) -> None:
    """The joins and leaves of elastic rollout ranks and trainers, in time order, into
    ``summary``; where ranks beyond the plan joined, the most ranks the job had (``grew_to``)."""
    def changes(key: str) -> list[dict[str, Any]]:
        return sorted((c for r in reports for c in (r.get("result") or {}).get(key, [])),
                      key=lambda c: c["time"])

    rollouts, trainers = changes("changes"), changes("trainer_changes")
    grown = {c["rank"] for c in rollouts + trainers
             if c["event"] == "join" and c["reason"] == BEYOND_PLAN}
    summary["joins"] = [c for c in rollouts if c["event"] == "join"]
    summary["leaves"] = [c for c in rollouts if c["event"] == "leave"]
    if rollouts:
        summary["summary"]["rollout_ranks"] = {"left": len(summary["leaves"]),
                                               "joined": len(summary["joins"])}
    if any("trainer_changes" in (r.get("result") or {}) for r in reports):
        summary["trainer_joins"] = [c for c in trainers if c["event"] == "join"]
        summary["trainer_leaves"] = [c for c in trainers if c["event"] == "leave"]
    if trainers:
        summary["summary"]["trainers"] = {
            "left": len(summary["trainer_leaves"]), "joined": len(summary["trainer_joins"]),
            "transitions_lost": sum(c.get("lost_transitions") or 0
                                    for c in summary["trainer_leaves"])}
    for part, joins in (("rollout_ranks", summary["joins"]),
                        ("trainers", summary.get("trainer_joins", []))):
        if any(c["rank"] in grown for c in joins):  # the most ranks the job ever had
            summary["summary"][part]["grew_to"] = max(grown) + 1


def run_beyond_plan(job: ValidatedJob, plan: LayoutPlan, run_dir: Path, store: Any,
                    env: RankEnv) -> None:
    """A rollout rank the plan did not have (``python -m app.join``), in this process: ``plan``
    has it (LayoutPlan.with_rollout_rank), ``store`` is the running job's; its trainer admits
    it at an update boundary, as a replacement, and it runs until the job ends."""
    from app.output.logs import setup_rank_logging

    timeline.reset()
    timeline.mark("started")
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as a rank before its watchdog: not fatal
    setup_rank_logging(run_dir, env.rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    try:
        with recording_failures(run_dir / "logs", env.rank, env.restart_count, env.node):
            ctx = CommContext()
            ctx.join_running_job(store, env.rank, env.world_size, int(job.comm.timeout))
            _join_running_job(job, plan, env, run_dir, ctx)
    except BaseException:
        log.exception("rank %d failed", env.rank, extra=FILE_ONLY)
        raise


def _join_running_job(
    cfg: ValidatedJob, plan: LayoutPlan, env: RankEnv, run_dir: Path, ctx: CommContext,
) -> None:
    """A rollout rank started while its job runs (a restart, one more torchrun or srun task, a
    rank beyond the plan): its trainer admits it at an update boundary; it reports like the
    others."""
    why = "beyond its plan" if env.rank >= env.world_size else "replacing a lost process"
    log.info("rank %d joins the running job (%s)", env.rank, why)
    _seed_everything(cfg.seed + env.rank)
    loop: Loop = cfg.loop
    result = loop(ctx, JobInfo(plan=plan, run_dir=run_dir, seed=cfg.seed, rank=env.rank,
                               env=env, shape=cfg.shape, joining=True,
                               stop_grace_s=float(cfg.launcher.shutdown_timeout)))
    report = {"rank": env.rank, "role": plan.role(env.rank), "host": socket.gethostname(),
              "pid": os.getpid(),
              "groups": {mode: info.__dict__ for mode, info in ctx.describe().items()},
              "result": result, "timeline": timeline.marks()}
    _reports_through_store(ctx, plan, report, float(cfg.comm.timeout), loop)
    ctx.destroy(barrier=False)
    wait_for_background(float(cfg.comm.timeout))


def _reports_through_store(
    ctx: CommContext, plan: LayoutPlan, report: dict[str, Any], timeout_s: float, loop: Loop,
) -> list[dict[str, Any]] | None:
    """Every rank's report, on rank 0, through the store: those of the ranks the loop says
    were there at the end (``Loop.reporting_ranks``: the RL runtime's trainers, replay ranks
    and the rollout ranks each trainer had)."""
    store = ctx.store
    store.set(f"report/{report['rank']}", json.dumps(report))
    if report["rank"] != 0:
        return None
    deadline = time.monotonic() + timeout_s
    wanted = LoopHooks(loop).reporting_ranks(ctx, plan, timeout_s)
    reports = []
    for rank in sorted(wanted):
        key = f"report/{rank}"
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if store.check([key]):
            reports.append(json.loads(store.get(key)))
        else:
            log.warning("rank %d did not report within %g s", rank, timeout_s)
    return reports


def _write_result(path: Path, text: str) -> None:
    """``result.json``, written aside and renamed: a failed write (a full disk) leaves no empty
    or cut file for the launcher to read, and its error names the file."""
    partial = path.with_name(f"{path.name}.tmp")
    try:
        with naming(path):
            partial.write_text(text)
            os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def loop_name(loop: Loop) -> str:
    """The loop's class as ``loop._target_`` names it: ``module.Class``."""
    return f"{type(loop).__module__}.{type(loop).__qualname__}"


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
