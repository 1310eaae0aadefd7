"""A replica's membership of a `meshserve router` (router.join), on its driver: it joins
with the address the router reaches its ZMQ frontend at, beats every
router.heartbeat_interval, joins again when the router does not know it (the router
restarted), tells the router when it starts draining and when it stopped, and drains when
the router asks (the admin API's drain). The socket is a DEALER, CURVE-encrypted with keys
from server.secret, its frames sealed with the secret (comm/membership.py)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import msgspec
import zmq

from meshserve.comm.auth import FrameAuth
from meshserve.comm.curve import make_curve_client
from meshserve.comm.membership import Heartbeat, Join, Leave, Refused, StopReplica, Welcome, replica_decoder
from meshserve.configs.schema import Config
from meshserve.launcher.network import host_address, interface_address

log = logging.getLogger("meshserve")

PURPOSE = "join"
JOIN_RETRY_S = 2.0
"""While no Welcome came: how often the Join is sent again (the router may not be up yet)."""
REFUSED_RETRY_S = 30.0
"""After the router refused it (another model): how long before it asks again."""
WILDCARDS = ("0.0.0.0", "*", "", "::", "[::]")


def advertised(address: str, config: Config) -> str:
    """`address` (a bound tcp:// address or host:port) as another node reaches it: a
    wildcard host becomes this node's address on cluster.interface, or its host name's."""
    scheme = "tcp://" if address.startswith("tcp://") else ""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if host in WILDCARDS:
        host = interface_address(config.cluster.interface) if config.cluster.interface else host_address()
    return f"{scheme}{host}:{port}"


class RouterMembership:
    def __init__(self, config: Config, zmq_address: str, http_address: str | None, vocab_size: int,
                 max_model_len: int, on_stop: Callable[[str], None]):
        """`zmq_address`, `http_address` (host:port): where this replica's frontends are
        bound; `on_stop(reason)`: drain and exit (the router asked)."""
        r = config.router
        self.zmq = r.advertise or advertised(zmq_address, config)
        http = None if http_address is None else "http://" + advertised(http_address, config)
        self.name = r.name or self.zmq
        self.interval = r.heartbeat_interval
        self.on_stop = on_stop
        self._join = Join(self.name, self.zmq, http, config.model.path, vocab_size, max_model_len, config.world_size)
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        make_curve_client(self._socket, config.server.secret, PURPOSE)
        self._socket.connect(r.join)
        self.router = r.join
        self._frames = FrameAuth(config.server.secret, PURPOSE)
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), replica_decoder()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.replica: int | None = None
        """Its place at the router, once welcomed."""
        self._next_send = 0.0
        self._thread = threading.Thread(target=self._run, name="meshserve-join", daemon=True)

    def start(self) -> "RouterMembership":
        log.info("joining the router at %s as %r (reached at %s)", self.router, self.name, self.zmq)
        self._thread.start()
        return self

    def leave(self, done: bool) -> None:
        """Tell the router this replica drains (`done`: it stopped)."""
        self._send(Leave(self.name, done))

    def close(self) -> None:
        self._closing.set()
        self._thread.join(5)
        self._socket.close(linger=0)
        self._ctx.term()

    def _send(self, message) -> None:
        with self._lock:
            try:
                self._socket.send(self._frames.seal(self._encoder.encode(message)), zmq.NOBLOCK)
            except zmq.Again:  # not connected yet (the router is not up): the next beat or Join says it
                pass

    def _run(self) -> None:
        while not self._closing.is_set():
            now = time.monotonic()
            if now >= self._next_send:
                self._send(self._join if self.replica is None else Heartbeat(self.name))
                self._next_send = now + (JOIN_RETRY_S if self.replica is None else self.interval)
            with self._lock:
                ready = self._socket.poll(100)
                frame = self._socket.recv(zmq.NOBLOCK) if ready else None
            if frame is not None:
                self._on_frame(frame)

    def _on_frame(self, frame: bytes) -> None:
        payload = self._frames.open(frame)
        try:
            message = self._decoder.decode(payload if payload is not None else frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("the router sent a frame that does not decode (%s): dropped", e)
            return
        if isinstance(message, Welcome):
            if self.replica != message.replica:
                log.info("joined the router at %s: replica %d", self.router, message.replica)
                self._next_send = time.monotonic() + self.interval  # the first beat, not the next Join's time
            self.replica = message.replica
        elif isinstance(message, Refused):
            if message.rejoin:
                log.warning("the router at %s does not know this replica: joining again", self.router)
                self.replica = None
            else:
                log.error("the router at %s refused this replica: %s (asking again in %.0f s)", self.router,
                          message.reason, REFUSED_RETRY_S)
                self._next_send = time.monotonic() + REFUSED_RETRY_S
        elif isinstance(message, StopReplica):
            log.warning("the router asks this replica to stop: %s", message.reason)
            self.on_stop(message.reason)
