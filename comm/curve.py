"""CURVE security (ZeroMQ's CurveZMQ: Curve25519 key exchange, every frame encrypted and
authenticated) with keys derived from the shared secret, so every node computes the same
keys without distributing any.

    auth = CurveAuthenticator(ctx, secret)            # the ZAP handler of ctx
    make_curve_server(pub, secret, "control", auth)   # before pub.bind(...)
    make_curve_client(sub, secret, "control")         # before sub.connect(...)
    ...
    auth.close()                                      # before ctx.term()

Each purpose ("control", "heartbeat", "client") has its own server and client keypair:

    server secret key = HMAC-SHA256(secret, "meshserve/curve/<purpose>/server")
    client secret key = HMAC-SHA256(secret, "meshserve/curve/<purpose>/client")

(32 bytes each, a Curve25519 secret key; the public keys follow from them). A client must
know the server's public key to complete the handshake, and the server's ZAP handler
admits only the client public key of the socket's purpose: a peer without the secret
neither reads nor sends anything. Security rests on the secret's entropy (use a long
random one).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from meshserve.comm.auth import DropLog

ZAP_DOMAIN_PREFIX = "meshserve/"

log = logging.getLogger(__name__)


def _secret_bytes(secret: str | bytes) -> bytes:
    data = secret.encode() if isinstance(secret, str) else secret
    if not data:
        raise ValueError("the shared secret is empty")
    return data


def _keypair(secret: str | bytes, purpose: str, side: str) -> tuple[bytes, bytes]:
    if not zmq.has("curve"):
        raise RuntimeError(f"this libzmq ({zmq.zmq_version()}) was built without CURVE security")
    label = f"meshserve/curve/{purpose}/{side}".encode()
    secret_key = z85.encode(hmac.new(_secret_bytes(secret), label, hashlib.sha256).digest())
    return zmq.curve_public(secret_key), secret_key


def server_keys(secret: str | bytes, purpose: str) -> tuple[bytes, bytes]:
    """(public, secret) z85-encoded keys of the bound side of `purpose`'s sockets."""
    return _keypair(secret, purpose, "server")


def client_keys(secret: str | bytes, purpose: str) -> tuple[bytes, bytes]:
    """(public, secret) z85-encoded keys of the connecting side of `purpose`'s sockets."""
    return _keypair(secret, purpose, "client")


class CurveAuthenticator:
    """The ZAP handler of one ZeroMQ context (a thread of pyzmq's): a CURVE server socket
    of that context, set up by `make_curve_server`, admits only the client key of its
    purpose. Start it before binding; close it after the context's sockets, before
    `ctx.term()` (it holds sockets of the context)."""

    def __init__(self, ctx: zmq.Context, secret: str | bytes):
        self._secret = _secret_bytes(secret)
        self._admitted: dict[str, bytes] = {}
        """ZAP domain -> the one client public key it admits."""
        self._lock = threading.Lock()
        self._refused = DropLog(log)
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("meshserve.comm.zap"))
        self._auth.start()

    def admit(self, purpose: str) -> str:
        """Admit `purpose`'s client key on the sockets of domain `meshserve/<purpose>`;
        returns the domain (the socket's ZAP_DOMAIN)."""
        domain = ZAP_DOMAIN_PREFIX + purpose
        with self._lock:
            self._admitted[domain] = client_keys(self._secret, purpose)[0]
        self._auth.configure_curve_callback(domain, credentials_provider=self)
        return domain

    def callback(self, domain: str, client_key: bytes) -> bool:
        """(The ZAP thread) whether the client with z85 public key `client_key` may connect."""
        with self._lock:
            wanted = self._admitted.get(domain)
        ok = wanted is not None and hmac.compare_digest(wanted, client_key)
        if not ok:
            self._refused("refused a CURVE peer on %s: its key is not the one derived from server.secret", domain)
        return ok

    def close(self) -> None:
        self._auth.stop()

    def __enter__(self) -> "CurveAuthenticator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_curve_server(sock: zmq.Socket, secret: str | bytes, purpose: str, auth: CurveAuthenticator) -> None:
    """Make `sock` (not yet bound) a CURVE server with `purpose`'s keys; `auth`, the
    authenticator of the socket's context, admits only `purpose`'s client key."""
    public, secret_key = server_keys(secret, purpose)
    sock.zap_domain = auth.admit(purpose).encode()
    sock.curve_secretkey = secret_key
    sock.curve_publickey = public
    sock.curve_server = True


def make_curve_client(sock: zmq.Socket, secret: str | bytes, purpose: str) -> None:
    """Make `sock` (not yet connected) a CURVE client of `purpose`'s server."""
    public, secret_key = client_keys(secret, purpose)
    sock.curve_serverkey = server_keys(secret, purpose)[0]
    sock.curve_publickey = public
    sock.curve_secretkey = secret_key
