"""Addresses of this node: a network interface's IPv4 address (cluster.interface), where the
driver binds its control-plane sockets and where node 0 is reached."""

from __future__ import annotations

import fcntl
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
