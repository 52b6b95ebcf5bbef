"""Which network interface gloo (and NCCL) bind their sockets to.

Left alone, gloo binds to the address this machine's hostname resolves to: on many cluster nodes
an address other ranks cannot reach, or 127.0.1.1 (Debian's default), which breaks a multi-host
run in confusing ways. So, unless the user set the variable:

- the rendezvous store is on loopback (every rank on this machine): GLOO_SOCKET_IFNAME = the
  loopback interface, so nothing listens beyond this machine;
- the store is on another address: GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) = the interface
  whose address the kernel would use to reach the store's host, the one route that is known to
  lead to the other ranks;
- the store's name resolves to loopback here but the job spans several hosts (this is the
  store's host, and its /etc/hosts maps its own name to 127.0.1.1, as Debian's does): the
  interface of the default route, else the only other interface with an IPv4 address; with
  neither, an error asks for GLOO_SOCKET_IFNAME rather than a job that hangs.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path

from rlcomm.errors import EnvironmentConfigError
from rlcomm.net import env

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_set_here: set[str] = set()  # variables this process set (not the user): a later init may redo them


def choose_socket_interfaces(master: str, spans_hosts: bool = False) -> dict[str, str]:
    """Set GLOO_SOCKET_IFNAME (and, for a remote master, NCCL_SOCKET_IFNAME) for a store at
    ``master`` unless the user set them; returns what was set here, and logs it.
    ``spans_hosts``: the job's ranks are known to run on more than this host."""
    for name in list(_set_here):  # a re-init with another master chooses afresh
        os.environ.pop(name, None)
        _set_here.discard(name)
    names: tuple[str, ...] = (env.GLOO_SOCKET_IFNAME, env.NCCL_SOCKET_IFNAME)
    if is_loopback(master) and spans_hosts:
        iface = outward_interface()
        resolved = _resolve(master)
        if iface is None and not all(os.environ.get(n) for n in names):
            raise EnvironmentConfigError(
                f"the rendezvous store {master} resolves to {resolved} (loopback) on this host, "
                "but the job spans several hosts and no interface toward them is evident; set "
                f"{env.GLOO_SOCKET_IFNAME} (and {env.NCCL_SOCKET_IFNAME}), or map {master} to "
                "an address the other hosts reach in /etc/hosts"
            )
        why = (
            f"the rendezvous store {master} resolves to {resolved} (loopback) here, but the "
            f"job spans hosts: {iface} ({address_of(iface) if iface else '?'}) faces them"
        )
    elif is_loopback(master):
        iface, why = loopback_interface(), f"the rendezvous store {master} is on loopback"
        names = (env.GLOO_SOCKET_IFNAME,)
    else:
        address = _route_source(master)
        iface = interface_of(address) if address else None
        why = f"its address {address} routes to the rendezvous store {master}"
    chosen = {}
    for name in names:
        if iface and not os.environ.get(name):
            os.environ[name] = iface
            _set_here.add(name)
            chosen[name] = iface
    if chosen:
        settings = " ".join(f"{k}={v}" for k, v in chosen.items())
        log.info("rlcomm set %s (%s)", settings, why)
    return chosen


def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "?"


def outward_interface() -> str | None:
    """The interface of the default route, else the only non-loopback one with an IPv4
    address (a host of a cluster network without a gateway); None when neither is evident."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
                return fields[0]
    loopback = loopback_interface()
    candidates = [n for _, n in socket.if_nameindex() if n != loopback and address_of(n)]
    return candidates[0] if len(candidates) == 1 else None


def loopback_interface() -> str | None:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & 0x8:  # IFF_LOOPBACK
            return name
    return next((n for n in names if n in ("lo", "lo0")), None)


def interface_of(address: str) -> str | None:
    """The interface that holds IPv4 ``address``, or None."""
    return next((n for _, n in socket.if_nameindex() if address_of(n) == address), None)


def address_of(interface: str) -> str | None:
    """The IPv4 address of ``interface``, or None (no such interface, or no IPv4 address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", interface.encode()[:15])
            reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def socket_address() -> str:
    """The address this process's gloo sockets use (its GLOO_SOCKET_IFNAME's), else the one
    this machine's hostname resolves to; "" when neither is known."""
    interface = os.environ.get(env.GLOO_SOCKET_IFNAME, "").split(",")[0]
    found = address_of(interface) if interface else None
    if found:
        return found
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""


def _route_source(host: str) -> str | None:
    """The local IPv4 address the kernel picks to reach ``host`` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None
