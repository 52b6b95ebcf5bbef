"""The Ray engine's cluster side: connecting (or starting a local Ray), checking that the ranks
fit, placing them (placement groups per role) and the rendezvous store the driver serves.

Placement: the trainers (with any replay or idle rank) in one ``PACK`` placement group, so
that they share nodes where they fit; the rollout ranks in a ``SPREAD`` group, across nodes.
Ranks are told apart by Ray's node id, never by IP: simulated nodes on one host share one.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.errors import ConfigError, RankFailedError
from app.launch import ray_reaper

if TYPE_CHECKING:
    from app.config.schema import RayConfig
    from rlcomm import LayoutPlan

LOOPBACK = "127.0.0.1"
NAMESPACE = "rlcomm"  # the actors' Ray namespace: ray.get_actor(name, namespace="rlcomm")
REACH_TIMEOUT_S = 10.0  # at most this (or comm.timeout) to reach launcher.ray.address's head

log = logging.getLogger("rlcomm.launcher")


@dataclass
class Placement:
    """Where each rank's actor goes: its placement group and bundle."""

    groups: dict[str, Any]  # role ("trainers", "rollouts") -> its placement group
    bundle_of: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> (role, index)

    def strategy(self, rank: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        role, index = self.bundle_of[rank]
        return PlacementGroupSchedulingStrategy(self.groups[role], placement_group_bundle_index=index)

    def group_id(self, rank: int) -> str:
        """The id of the placement group that holds ``rank``'s bundle, as Ray prints it."""
        return str(self.groups[self.bundle_of[rank][0]].id.hex())

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups.values():
            with contextlib.suppress(Exception):  # already gone with the cluster
                remove_placement_group(group)


def quiet_console() -> None:
    """The ranks' lines on the driver's console as under the local launcher: whole (Ray's
    dedup off), without Ray's ``(RankActor pid=...)`` prefix (each line names its rank)."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")


def connect(settings: RayConfig, world_size: int,
            timeout_s: float) -> subprocess.Popen[bytes] | None:
    """Connects this process to ``launcher.ray.address``, or starts a local Ray sized for the
    run (null); returns, for a Ray started here, the process that ends it should this one die
    (app/launch/ray_reaper.py), to be ended after ``ray.shutdown()``. An address that cannot be
    reached is one line (ConfigError), within ``timeout_s``."""
    import ray

    address = settings.address
    if address is None:
        cores = os.cpu_count() or 1
        if settings.cpus_per_rank > cores:
            raise ConfigError(f"launcher.ray.cpus_per_rank={settings.cpus_per_rank:g}: the local "
                              f"Ray is this machine, which has {cores} CPUs")
        # The local Ray is this machine, as the local launcher's ranks are: it declares what
        # the run asks for where the machine has fewer cores (the ranks then share them).
        cpus = max(cores, math.ceil(world_size * settings.cpus_per_rank))
        token = uuid.uuid4().hex
        os.environ[ray_reaper.TOKEN_VARIABLE] = token  # every process of this Ray inherits it
        reaper = subprocess.Popen([sys.executable, ray_reaper.__file__, str(os.getpid()), token],
                                  start_new_session=True)
        # "local": a new Ray, even where another runs on this machine (`ray start`, RAY_ADDRESS).
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True,
                 configure_logging=False, namespace=NAMESPACE)
        return reaper
    if address != "auto":
        _check_reachable(address, min(timeout_s, REACH_TIMEOUT_S))
    try:
        ray.init(address=address, log_to_driver=True, configure_logging=False,
                 namespace=NAMESPACE)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise ConfigError(f"launcher.ray.address={address}: cannot connect to a Ray cluster "
                          f"there ({gist(err)})") from None
    return None


def _check_reachable(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ConfigError(f"launcher.ray.address={address}: no Ray head answers there "
                          f"({err.strerror or type(err).__name__}, {timeout_s:g} s)") from None


def check_fits(settings: RayConfig, world_size: int, started_here: bool) -> None:
    """One line (ConfigError) where a rank asks more than any alive node has, or where the run
    asks more than a Ray started here has (it cannot grow)."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    asked = {"CPU": settings.cpus_per_rank, "GPU": settings.gpus_per_rank}
    field_of = {"CPU": "launcher.ray.cpus_per_rank", "GPU": "launcher.ray.gpus_per_rank"}
    for resource, per_rank in asked.items():
        largest = max((n.get(resource, 0.0) for n in nodes), default=0.0)
        if per_rank > largest:
            raise ConfigError(f"{field_of[resource]}={per_rank:g}: no node of the Ray cluster "
                              f"has that many ({resource}: {largest:g} on its largest node)")
        total = sum(n.get(resource, 0.0) for n in nodes)
        if started_here and per_rank * world_size > total:
            raise ConfigError(f"{field_of[resource]}={per_rank:g} x {world_size} ranks: the "
                              f"local Ray has {resource}: {total:g}")


def place(plan: LayoutPlan, settings: RayConfig) -> Placement:
    """Placement groups for the ranks, ready; one line (RankFailedError) where the cluster
    cannot place them within ``launcher.ray.placement_timeout``."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group

    bundle = {k: v for k, v in (("CPU", settings.cpus_per_rank),
                                ("GPU", settings.gpus_per_rank)) if v > 0}
    rollouts = sorted(plan.rollouts)
    roles = {"trainers": [r for r in range(plan.world_size) if r not in set(rollouts)],
             "rollouts": rollouts}
    strategies = {"trainers": "PACK", "rollouts": "SPREAD"}
    placement = Placement(groups={})
    for role, ranks in roles.items():
        if not ranks:
            continue
        placement.groups[role] = placement_group([dict(bundle) for _ in ranks],
                                                 strategy=strategies[role])
        placement.bundle_of.update({rank: (role, i) for i, rank in enumerate(ranks)})
    try:
        ray.get([g.ready() for g in placement.groups.values()],
                timeout=float(settings.placement_timeout))
    except GetTimeoutError:
        placement.remove()
        free = ray.available_resources()
        raise RankFailedError(
            f"launcher.ray: Ray could not place the {plan.world_size} ranks ({bundle} each) "
            f"within launcher.ray.placement_timeout={settings.placement_timeout:g} s; free now: "
            f"{ {k: v for k, v in sorted(free.items()) if k in ('CPU', 'GPU')} }") from None
    return placement


def serve_store(host: str, timeout_s: float) -> tuple[Any, int]:
    """The run's rendezvous store, served by the driver on ``host``, on a port the kernel
    picks and the store keeps (bound once: no bind-close-rebind race); no rank holds it."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    listener = socket.create_server((host, 0), backlog=4096)
    port = int(listener.getsockname()[1])
    store = TCPStore(host, port, None, True, timedelta(seconds=timeout_s),
                     wait_for_workers=False, master_listen_fd=listener.fileno())
    listener.detach()  # the store closes the descriptor it serves on
    return store, port


def store_host(started_here: bool) -> str:
    """Where the ranks reach the driver's store: loopback for a local Ray (nothing exposed),
    else this node's IP as Ray knows it."""
    if started_here:
        return LOOPBACK
    import ray

    return str(ray.util.get_node_ip_address())


def gist(err: BaseException) -> str:
    """A Ray error in a few words: its type and its first line (Ray's run on for pages)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def kill_actor(actor: Any) -> None:
    """Ends ``actor`` for good (nothing where it is gone already)."""
    import ray

    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)
