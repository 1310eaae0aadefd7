"""Where and how the driver's control-plane and heartbeat sockets listen, and how the
other ranks connect to them.

- One node (`ipc_dir`): unix sockets in a directory only the deployment's user can enter
  (mode 0700; the launcher makes it and removes it): no other user of the machine can
  connect, and nothing crosses a network.
- Several nodes (`host`): TCP on ephemeral ports of `host`; with a secret, CURVE
  (comm/curve.py): encrypted, and only peers holding the secret complete the handshake.
  Without a secret (cluster.insecure_control_plane) plain TCP.

A rank decides from the address it was given: a tcp:// address with a secret is a CURVE
server, so the two ends always agree.
"""

from __future__ import annotations

import os
import stat

import zmq

from meshserve.comm.curve import CurveAuthenticator, make_curve_client, make_curve_server

UNIX_PATH_MAX = 107
"""Longest path of a unix socket (sun_path is 108 bytes on Linux, NUL included)."""
LONGEST_SOCKET_NAME = "heartbeat-pull"


def ipc_dir_fits(path: str) -> bool:
    """Whether the sockets' paths in directory `path` stay within UNIX_PATH_MAX."""
    return len(os.fsencode(path)) + 1 + len(LONGEST_SOCKET_NAME) <= UNIX_PATH_MAX


class Listener:
    """The bound side of one channel (`purpose`: "control" or "heartbeat") in context `ctx`:
    on `host` (TCP) or in `ipc_dir` (one node), exactly one of them."""

    def __init__(self, ctx: zmq.Context, purpose: str, secret: str | None, host: str | None = None,
                 ipc_dir: str | None = None):
        if (host is None) == (ipc_dir is None):
            raise ValueError("a listener binds on a host or in an ipc directory, exactly one of them")
        if ipc_dir is not None:
            mode = stat.S_IMODE(os.stat(ipc_dir).st_mode)
            if mode & 0o077:
                raise PermissionError(f"{ipc_dir}: mode {mode:o}: the control plane's directory must be private "
                                      f"(0700)")
            if not ipc_dir_fits(ipc_dir):
                raise ValueError(f"{ipc_dir}: {len(os.fsencode(ipc_dir))} bytes leave no room for the socket names "
                                 f"within a unix socket path's {UNIX_PATH_MAX} bytes")
        self.purpose, self.secret, self.host, self.ipc_dir = purpose, secret, host, ipc_dir
        self._auth = CurveAuthenticator(ctx, secret) if host is not None and secret is not None else None

    @property
    def security(self) -> str:
        """How the sockets are protected, for the start-up log line."""
        if self.ipc_dir is not None:
            return "unix sockets in a directory of mode 0700"
        return "CURVE-encrypted, keys from server.secret" if self._auth is not None else \
            "plain TCP (cluster.insecure_control_plane)"

    def bind(self, sock: zmq.Socket, name: str) -> str:
        """Bind `sock` as this listener's socket `name` (e.g. "control-pub"); returns its address."""
        if self.ipc_dir is not None:
            sock.bind(f"ipc://{self.ipc_dir}/{name}")
        else:
            if self._auth is not None:
                make_curve_server(sock, self.secret, self.purpose, self._auth)
            sock.bind(f"tcp://{self.host}:0")
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def close(self) -> None:
        """Stop the authenticator, after the sockets closed and before the context terminates."""
        if self._auth is not None:
            self._auth.close()
            self._auth = None


def connect(sock: zmq.Socket, address: str, secret: str | None, purpose: str) -> None:
    """Connect a rank's `sock` to the driver's `address` (a CURVE client on TCP with a secret)."""
    if secret is not None and address.startswith("tcp://"):
        make_curve_client(sock, secret, purpose)
    sock.connect(address)
