"""``--only membership_scale``: one membership (rlcomm.elastic) of N members against one store,
by simulation (docs/benchmarks.md, "One store, N members").

N members with no model (threads, each with a store connection of its own and a heartbeat:
benchmarks/membership_sim.py) and their leader (the measuring process) against one real
``TCPStore`` in a process of its own, for N in ``SIZES``. Every member heartbeats
(``rlcomm.elastic.Liveness``) throughout:

- **heartbeats only**: ``IDLE_S`` seconds of nothing else: the store's requests/s and CPU;
- **form an epoch**: the leader proposes the next epoch with every member and settles it
  (``Leader.propose``, ``Leader.settle``), while every member waits for it, acknowledges it and
  reads its settled members (``Member.newer_epoch``, ``Member.acknowledge``): seconds from the
  proposal to the last member's read, and to the leader's settling; repeated for at least
  ``FORM_WINDOW_S`` and ``MIN_FORMS`` epochs; the store's requests/s and CPU over them;
- **notice a lost member**: one member's heartbeat stops and it answers no more; the leader
  does what the lead trainer does when its group fails (app/runtime/membership/trainers.py):
  ``Liveness.watch`` of its members, the next epoch with all of them, settled with the watch
  telling who is gone: seconds from the watch to the moment it names the lost member, and to
  the epoch settled without it; a live member named too is a false loss.

The store protocol only: forming each epoch's gloo group among N members is out of reach on 2
cores, and not what this measures. Members, leader and store share this machine's cores: where
the members' processes take the cores (their CPU, and their heartbeats falling behind those
due, N / ``BEAT_S``), the members' side sets the pace, not the store.

One N alone, its figures as JSON: ``python -m benchmarks.membership_scale N --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlcomm.elastic import BEAT_S, Leader, Liveness

from .core import PER_SECOND, SECONDS, Row, Settings, Stat
from .membership_sim import (
    MODE,
    TIMEOUT,
    CountingStore,
    Hosts,
    StoreOnly,
    Usage,
    current_load,
    hosting,
)
from .procs import timed_command

NAME = "membership_scale"
SIZES = (16, 64, 256, 1024, 2048, 4096)
QUICK_SIZES = (16, 256, 1024)
# Members per process holding them: each process's threads share its GIL.
PER_PROCESS = 128
IDLE_S = 3.0
FORM_WINDOW_S, MIN_FORMS, MAX_FORMS = 2.0, 3, 200
LOSSES = 2
# How long the leader waits for acknowledgements: the app's default patience (0.8 x the hang
# timeout of comm.timeout=300, docs/failures.md).
PATIENCE_S = 216.0
CORES = "cores"
CPU_TICKS_S = 0.01  # a process's CPU time comes in clock ticks
RUN_TIMEOUT_S = 600.0  # one N, set-up and teardown included
RESOLVER = "timeout:1 attempts:1"  # name lookups in a measuring process: see measure_apart


@dataclass(frozen=True)
class Phase:
    """One phase: the requests sent to the store by role, the store's CPU (cores) and its
    responses/s, and the CPU (cores) of the processes holding the members."""

    wall_s: float
    requests: dict[str, int]
    cpu: float
    responses_per_s: float
    members_cpu: float

    @classmethod
    def between(cls, start: Usage, end: Usage) -> Phase:
        wall = end.at - start.at
        requests = end.requests.copy()
        requests.subtract(start.requests)
        return cls(wall, dict(requests), (end.cpu_s - start.cpu_s) / wall,
                   (end.responses - start.responses) / wall,
                   (end.members_cpu_s - start.members_cpu_s) / wall)

    @property
    def per_s(self) -> float:
        return sum(self.requests.values()) / self.wall_s

    def beats(self, members: int) -> float:
        """The heartbeats sent over those due (``members`` / BEAT_S)."""
        return self.requests["heartbeat"] / (members * self.wall_s / BEAT_S)

    def cpu_per_request_us(self) -> float | None:
        """The store's CPU per request, where it used enough to tell (``CPU_TICKS_S`` of
        psutil's resolution, 20 times over)."""
        if self.cpu * self.wall_s < 20 * CPU_TICKS_S:
            return None
        return 1e6 * self.cpu / self.per_s


@dataclass
class Scale:
    """One N's figures (see the module's docstring); ``load``: the 1/5/15-minute load averages
    as each phase ended (``start``: before the processes started)."""

    n: int
    processes: int
    setup_s: float = 0.0
    load: dict[str, str] = field(default_factory=dict)
    idle: Phase | None = None
    forming: Phase | None = None
    form_s: list[float] = field(default_factory=list)  # proposal -> last member's read
    settle_s: list[float] = field(default_factory=list)  # proposal -> the leader settled
    left_out: int = 0  # members left out of an epoch they were proposed for
    notice_s: list[float] = field(default_factory=list)  # watch -> the lost member named
    lose_s: list[float] = field(default_factory=list)  # watch -> settled without it
    false_losses: int = 0  # live members named lost

    @classmethod
    def of(cls, record: dict[str, Any]) -> Scale:
        """As :func:`main` wrote it."""
        phases = {k: Phase(**record[k]) for k in ("idle", "forming") if record[k] is not None}
        return cls(**{**record, **phases})

    def per_member_and_epoch(self, role: str) -> float:
        """The requests ``role`` sent to form one epoch, per member."""
        assert self.forming is not None
        return self.forming.requests[role] / len(self.form_s) / self.n


class Simulation:
    """The leader of ``hosts``' members, in this process, on a store connection of its own."""

    def __init__(self, hosts: Hosts, n: int, patience_s: float = PATIENCE_S) -> None:
        self.hosts, self.patience_s = hosts, patience_s
        self.store = CountingStore(hosts.client, "leader")
        self.leader = Leader(StoreOnly(self.store, 0).context(), MODE,
                             planned=list(range(n + 1)), hosts={}, timeout=TIMEOUT)
        # Not on the leader's host (in a job of thousands, nearly every member is elsewhere):
        # a member is lost by its heartbeat, as on another host.
        self.liveness = Liveness(self.store, self.leader.keys,
                                 dict.fromkeys(range(1, n + 1), "elsewhere"))
        self.liveness.note(self.leader.members)

    def usage(self) -> Usage:
        return self.hosts.usage([self.store])

    def form(self) -> tuple[float, float, int]:
        """One epoch with every member: seconds to the last member's read and to the leader's
        settling, and how many were left out."""
        members = list(self.leader.members)
        self.hosts.go()  # every member goes to wait for the next epoch, as the leader proposes
        began = time.monotonic()
        self.leader.propose(members, [])
        missing = self.leader.settle(self.patience_s)
        settled = time.monotonic()
        reports = self.hosts.reports()
        if len(reports) != len(members):
            raise RuntimeError(f"{len(reports)} of {len(members)} members answered the epoch")
        if any(read != len(members) + 1 for _, outcome, read in reports if outcome == "in"):
            raise RuntimeError("a member read settled members other than those proposed")
        left_out = len(missing) + sum(outcome != "in" for _, outcome, _ in reports)
        return max(at for at, _, _ in reports) - began, settled - began, left_out

    def lose(self) -> tuple[float, float, int]:
        """One member lost: seconds to it named and to the epoch settled without it, and how
        many live members were named too."""
        lost = self.leader.members[-1]
        self.hosts.stop(lost)
        began = time.monotonic()
        gone = self.liveness.watch(self.leader.members)
        named: list[float] = []

        def watching(waiting: list[int]) -> list[int]:
            found = gone(waiting)
            if lost in found and not named:
                named.append(time.monotonic())
            return found

        self.hosts.go()
        self.leader.propose(list(self.leader.members), [])
        missing = self.leader.settle(self.patience_s, gone=watching)
        settled = time.monotonic()
        self.hosts.reports()
        if lost not in missing or not named:
            raise RuntimeError(f"member {lost} stopped, and was not named lost ({missing})")
        return named[0] - began, settled - began, len(missing) - 1


def measure(n: int, processes: int | None = None, idle_s: float = IDLE_S,
            form_window_s: float = FORM_WINDOW_S, losses: int = LOSSES,
            patience_s: float = PATIENCE_S) -> Scale:
    """Every figure for ``n`` members on ``processes`` processes (default: ``PER_PROCESS``
    members in each); ``patience_s``: how long the leader waits for acknowledgements."""
    scale = Scale(n, processes or -(-n // PER_PROCESS), load={"start": current_load()})
    with hosting(n, scale.processes) as hosts:
        scale.setup_s = hosts.setup_s
        sim = Simulation(hosts, n, patience_s)
        start = sim.usage()
        time.sleep(idle_s)
        scale.idle = Phase.between(start, sim.usage())
        scale.load["idle"] = current_load()
        start = sim.usage()
        while len(scale.form_s) < MAX_FORMS and (
                len(scale.form_s) < MIN_FORMS or time.monotonic() - start.at < form_window_s):
            formed, settled, left_out = sim.form()
            scale.form_s.append(formed)
            scale.settle_s.append(settled)
            scale.left_out += left_out
        scale.forming = Phase.between(start, sim.usage())
        scale.load["form"] = current_load()
        for _ in range(losses):
            noticed, settled, others = sim.lose()
            scale.notice_s.append(noticed)
            scale.lose_s.append(settled)
            scale.false_losses += others
        scale.load["lose"] = current_load()
    return scale


def rows_of(scale: Scale) -> list[Row]:
    """Six rows for one N, each with the load average as its phase ended."""
    idle, forming, load = scale.idle, scale.forming, scale.load
    assert idle is not None and forming is not None
    name = f"N={scale.n:,}:"
    by_role = ", ".join(f"{role} {count / forming.wall_s:,.0f}/s"
                        for role, count in forming.requests.items())
    rows = [
        Row(NAME, f"{name} form an epoch (to the last member's read)", SECONDS,
            Stat.of(scale.form_s),
            note=f"{len(scale.form_s)} epochs; the leader settled in "
                 f"{statistics.median(scale.settle_s):.3f} s; {scale.left_out} left out; "
                 f"load {load['form']}"),
        Row(NAME, f"{name} notice a lost member", SECONDS, Stat.of(scale.notice_s),
            note=f"{len(scale.notice_s)} losses; settled without it in "
                 f"{statistics.median(scale.lose_s):.3f} s; {scale.false_losses} false "
                 f"losses; load {load['lose']}"),
        Row(NAME, f"{name} store requests/s, heartbeats only", PER_SECOND,
            Stat.single(idle.per_s),
            note=f"heartbeats {idle.beats(scale.n):.0%} of due; load {load['idle']}"),
        Row(NAME, f"{name} store requests/s, forming epochs", PER_SECOND,
            Stat.single(forming.per_s), note=f"{by_role}; load {load['form']}"),
        Row(NAME, f"{name} store CPU, heartbeats only", CORES, Stat.single(idle.cpu),
            note=f"members' processes {idle.members_cpu:.2f} cores; load {load['idle']}"),
        Row(NAME, f"{name} store CPU, forming epochs", CORES, Stat.single(forming.cpu),
            note=f"members' processes {forming.members_cpu:.2f} cores; load {load['form']}"),
    ]
    for row in rows:
        row.extra.update(load=load, processes=scale.processes, setup_s=scale.setup_s)
    return rows


COLUMNS = ("N (processes)", "form an epoch, s", "the leader settled, s",
           "notice a lost member, s", "false losses",
           "requests per epoch and member: members, leader",
           "requests/s: heartbeats only, forming", "heartbeats sent / due: only, forming",
           "store CPU, cores: only, forming", "store CPU per request, us: only, forming",
           "members' CPU, cores: only, forming", "load (1 min): before, only, forming, losing")


def table(scales: list[Scale]) -> str:
    """The section's figures, one line per N: medians [min..max], the load averages beside."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for s in scales:
        idle, forming = s.idle, s.forming
        assert idle is not None and forming is not None
        loads = ", ".join(s.load[phase].split(" / ")[0] for phase in ("start", "idle", "form",
                                                                       "lose"))
        per_request = ", ".join("-" if us is None else f"{us:.1f}" for us in
                                (idle.cpu_per_request_us(), forming.cpu_per_request_us()))
        cells = (f"{s.n:,} ({s.processes})", _spread(s.form_s), _spread(s.settle_s),
                 _spread(s.notice_s), str(s.false_losses),
                 f"{s.per_member_and_epoch('member'):.2f}, {s.per_member_and_epoch('leader'):.2f}",
                 f"{idle.per_s:,.0f}, {forming.per_s:,.0f}",
                 f"{idle.beats(s.n):.0%}, {forming.beats(s.n):.0%}",
                 f"{idle.cpu:.2f}, {forming.cpu:.2f}", per_request,
                 f"{idle.members_cpu:.2f}, {forming.members_cpu:.2f}", loads)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}..{max(values):.3f}]"


def run(settings: Settings) -> list[Row]:
    """The section in ``python -m benchmarks --only membership_scale``: each N in a fresh
    process (:func:`measure_apart`), one after the other; the table also goes to
    ``<out>/membership_scale/table.md``."""
    scales, rows = [], []
    out = settings.out_dir / NAME
    for n in QUICK_SIZES if settings.quick else SIZES:
        print(f"   N={n:,} ...", flush=True)
        scale = measure_apart(n, out / f"n{n}.json")
        scales.append(scale)
        rows += rows_of(scale)
    text = table(scales)
    print(text, flush=True)
    (out / "table.md").write_text(text + "\n")
    return rows


def measure_apart(n: int, path: Path, *options: str) -> Scale:
    """:func:`measure` in a fresh ``python -m benchmarks.membership_scale`` (killed with its
    processes past ``RUN_TIMEOUT_S``), its figures written to ``path`` and read back.

    Fresh, so that its name lookups follow ``RESOLVER``: torch looks up the peer's name of
    every new store connection, on both sides, in the store's event loop too (c10d's
    socket.cpp). This machine's resolver drops lookups past a few a second, and a dropped one
    costs 5 s (twice), with every member waiting on the store meanwhile. With one attempt of
    1 s, the first lookup that fails makes torch stop looking names up in that process
    (pytorch#159007), and the set-up takes seconds rather than an hour. glibc reads the option
    once per process, and a forked process keeps its parent's: hence a fresh one. The measured
    phases open no connection."""
    path.parent.mkdir(parents=True, exist_ok=True)
    argv = ["env", f"RES_OPTIONS={RESOLVER}", sys.executable, "-m", f"benchmarks.{NAME}",
            str(n), "--out", str(path), *options]
    _, done = timed_command(argv, RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"N={n}: exit code {done.returncode}: {done.stderr[-2000:]}")
    return Scale.of(json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int, help="members (the leader besides)")
    parser.add_argument("--out", type=Path, required=True, help="the figures' file (JSON)")
    parser.add_argument("--processes", type=int,
                        help=f"processes holding the members (default: {PER_PROCESS} in each)")
    parser.add_argument("--idle-s", type=float, default=IDLE_S)
    parser.add_argument("--form-window-s", type=float, default=FORM_WINDOW_S)
    parser.add_argument("--losses", type=int, default=LOSSES)
    parser.add_argument("--patience-s", type=float, default=PATIENCE_S)
    args = parser.parse_args(argv)
    scale = measure(args.n, args.processes, args.idle_s, args.form_window_s, args.losses,
                    args.patience_s)
    args.out.write_text(json.dumps(asdict(scale), indent=2))
    print(table([scale]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
