"""Addresses of this node: a network interface's IPv4 address (cluster.interface), where the
driver binds its control-plane sockets and where node 0 is reached."""

from __future__ import annotations

import fcntl
import random
import socket
import struct

from meshserve.launcher.errors import StartupError

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class NetworkError(StartupError):
    """An interface that is not there, or has no IPv4 address."""


def interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` on this node."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError as e:
            raise NetworkError(f"cluster.interface={name!r}: no IPv4 address on this node ({e.strerror}); "
                               f"its interfaces: {', '.join(interface_names())}") from None
    return socket.inet_ntoa(packed[20:24])


def host_address() -> str:
    """This node's address as its host name resolves (when no interface is configured)."""
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return socket.gethostbyname(socket.gethostname())


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (outgoing connections, bind to port 0)."""
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` now and that the kernel will not hand out by itself.

    A port taken with bind(0) lies in the kernel's ephemeral range: between the pick and the
    server's bind, any outgoing connection or listener on port 0 (gloo opens dozens) may take
    it. Ports below that range are given only to whoever names them. Never the same port twice
    in one process."""
    low, _ = _ephemeral_range()
    candidates = list(range(max(1024, low - 20000), low))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:200]:
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
