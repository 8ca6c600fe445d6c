"""This node's address and network interface towards the rendezvous master.

With nodes on different addresses, gloo and NCCL must open their sockets on the interface
that reaches rank 0's node: by default gloo binds the address this host's name resolves to,
which on a cluster node may be another network's, or a loopback one. :func:`route_to` asks
the kernel which source address a packet to the master leaves from (a UDP ``connect``: no
packet is sent) and finds the interface that holds it; :func:`set_socket_ifname` exports it
as ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` unless the user set them. IPv4 only:
an IPv6-only master gets no interface, and gloo's own choice stands.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, MutableMapping, Optional, Tuple

from hetseq_hpc.env.hostlist import expand_hostlist
from hetseq_hpc.env.world import WorldInfo
from hetseq_hpc.errors import WorldError

log = logging.getLogger(__name__)

#: the variables that name the interface gloo and NCCL open their sockets on
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def is_loopback(addr: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (``127.0.0.0/8``, ``::1``)."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B

#: interface name -> (IPv4 address, netmask), as :func:`interface_addresses` reads them
Interfaces = Dict[str, Tuple[str, str]]


@dataclass(frozen=True)
class Route:
    """How this node reaches the master.

    Attributes:
        master: the master's IPv4 address (its name resolved).
        address: this node's source address towards it.
        interface: the interface that holds ``address``.
    """

    master: str
    address: str
    interface: str


def _ioctl_ipv4(sock: socket.socket, request: int, name: str) -> Optional[str]:
    try:
        packed = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:  # no IPv4 address on this interface
        return None
    return socket.inet_ntoa(packed[20:24])


def interface_addresses() -> Interfaces:
    """Every interface of this network namespace with an IPv4 address: name -> (address,
    netmask) (Linux ``SIOCGIFADDR``; the primary address of each)."""
    found: Interfaces = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            addr = _ioctl_ipv4(sock, _SIOCGIFADDR, name)
            mask = _ioctl_ipv4(sock, _SIOCGIFNETMASK, name)
            if addr is not None:
                found[name] = (addr, mask or "255.255.255.255")
    return found


def interface_of(address: str, interfaces: Interfaces) -> Optional[str]:
    """The interface that holds ``address``, else the one whose network contains it (a
    loopback source such as ``127.0.0.11`` belongs to ``lo``, ``127.0.0.1/8``), else None."""
    for name, (addr, _) in interfaces.items():
        if addr == address:
            return name
    ip = ipaddress.ip_address(address)
    for name, (addr, mask) in interfaces.items():
        if ip in ipaddress.ip_network(f"{addr}/{mask}", strict=False):
            return name
    return None


def _source_address(master: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((master, 9))  # UDP: picks the route, sends nothing
        return str(sock.getsockname()[0])


def route_to(
    host: str,
    interfaces: Callable[[], Interfaces] = interface_addresses,
    source: Callable[[str], str] = _source_address,
) -> Optional[Route]:
    """This node's route to ``host`` (a name or an IPv4 address), or None when the name does
    not resolve to an IPv4 address, no route leads there, or no interface holds the source
    address. ``interfaces`` and ``source`` are the system's unless a test injects them."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)
        master = str(infos[0][4][0])
        address = source(master)
    except (OSError, IndexError):
        return None
    interface = interface_of(address, interfaces())
    return None if interface is None else Route(master, address, interface)


def set_socket_ifname(
    master_addr: str,
    env: MutableMapping[str, str],
    spans_nodes: bool,
    route: Callable[[str], Optional[Route]] = route_to,
) -> Tuple[Optional[Route], List[str]]:
    """Set ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` in ``env`` to the interface of
    this node's route to ``master_addr``, each unless already set.

    A loopback route in a job that ``spans_nodes`` sets nothing: the master's name resolves
    to this host itself (rank 0's node, a ``127.0.1.1`` line of /etc/hosts, or every node on
    one host), and binding the loopback interface would hide this rank from other hosts.

    Returns:
        (the route or None when none was found, the names of the variables set here).
    """
    found = route(master_addr)
    if found is None or (spans_nodes and ipaddress.ip_address(found.address).is_loopback):
        return found, []
    set_here = [name for name in IFNAME_VARIABLES if not env.get(name)]
    for name in set_here:
        env[name] = found.interface
    return found, set_here


def spans_nodes(world: WorldInfo, env: Mapping[str, str]) -> bool:
    """Whether the job may span more than one node: True unless it is a Slurm job whose
    ``SLURM_JOB_NODELIST`` names one node (a launcher's ``RANK``/``WORLD_SIZE`` say nothing
    about nodes)."""
    if world.source != "slurm":
        return True
    try:
        return len(set(expand_hostlist(env.get("SLURM_JOB_NODELIST", "")))) != 1
    except WorldError:
        return True


def use_route_to_master(world: WorldInfo, env: MutableMapping[str, str]) -> Optional[Route]:
    """Set gloo's and NCCL's interface from this node's route to the master (unless the user
    set them; :func:`set_socket_ifname`) and log this node's address once. Nothing for a
    single rank.

    Returns:
        the route found, or None (one rank, or none found: gloo's default stands).
    """
    if world.world_size < 2:
        return None
    route, set_here = set_socket_ifname(world.master_addr, env, spans_nodes(world, env))
    if route is None:
        log.info(
            "rank %d on node %s: no IPv4 route to the master %s found; gloo picks its interface",
            world.rank,
            world.node_name,
            world.master_addr,
        )
        return None
    log.info(
        "rank %d on node %s: address %s, interface %s towards the master %s (%s); "
        "GLOO_SOCKET_IFNAME=%s (%s)",
        world.rank,
        world.node_name,
        route.address,
        route.interface,
        world.master_addr,
        route.master,
        env.get("GLOO_SOCKET_IFNAME", "unset"),
        "set from the route"
        if set_here
        else "already set"
        if env.get("GLOO_SOCKET_IFNAME")
        else "a loopback route in a job that may span nodes: gloo's default",
    )
    return route


__all__ = [
    "IFNAME_VARIABLES",
    "Route",
    "interface_addresses",
    "interface_of",
    "is_loopback",
    "route_to",
    "set_socket_ifname",
    "spans_nodes",
    "use_route_to_master",
]
