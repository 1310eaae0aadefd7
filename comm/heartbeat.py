"""Liveness of the ranks, on sockets and threads of its own.

Every rank runs a `HeartbeatMonitor` thread: it sends a Heartbeat every `interval` and
watches for its peers' (the driver watches every other rank; the other ranks watch the
driver). A peer silent for longer than `deadline`, or the driver's Abort, makes the
monitor call `on_failure(reason)` once. It does not rely on the rank's main thread,
which may be stuck in a collective with the dead rank.

driver:   PUB  --(Heartbeat, Abort)-->  SUB   other ranks
driver:   PULL <--(Heartbeat)---------  PUSH  other ranks

The driver's sockets listen like the control plane's (comm/endpoints.py: a private unix
socket directory on one node, CURVE across nodes with a secret). With a shared secret every
frame also carries an HMAC tag (comm/auth.py); a frame that does not open with it, or does
not decode, is dropped with a (rate-limited) warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
from msgspec import Struct

from meshserve.comm.auth import DropLog, FrameAuth
from meshserve.comm.endpoints import Listener, connect

log = logging.getLogger(__name__)


class Heartbeat(Struct, frozen=True, tag="heartbeat"):
    rank: int
    session: str


class Abort(Struct, frozen=True, tag="abort"):
    """The driver gives up: every rank must stop."""

    reason: str
    session: str


LivenessMessage = Heartbeat | Abort


class HeartbeatMonitor:
    def __init__(self, rank: int, world_size: int, session: str, interval: float, deadline: float,
                 on_failure: Callable[[str], None], host: str | None = None, addresses: str | None = None,
                 secret: str | None = None, ipc_dir: str | None = None):
        """The driver (rank 0) passes `host` or `ipc_dir` (comm/endpoints.py) and binds; the
        others pass the driver's `addresses` and connect. `secret`: server.secret."""
        self.rank, self.world_size, self.session = rank, world_size, session
        self.interval, self.deadline = interval, deadline
        self.on_failure = on_failure
        self._ctx = zmq.Context()
        self._listener = Listener(self._ctx, "heartbeat", secret, host, ipc_dir) if rank == 0 else None
        self._out = self._ctx.socket(zmq.PUB if rank == 0 else zmq.PUSH)
        self._in = self._ctx.socket(zmq.PULL if rank == 0 else zmq.SUB)
        for sock in (self._out, self._in):
            sock.setsockopt(zmq.LINGER, 0)
        self._auth = FrameAuth(secret, "heartbeat")
        self._dropped = DropLog(log)
        if self._listener is not None:
            self._in.setsockopt(zmq.MAXMSGSIZE, 64 << 10)  # anyone may connect; a heartbeat is tens of bytes
            self.addresses = f"{self._listener.bind(self._out, 'heartbeat-pub')} " \
                             f"{self._listener.bind(self._in, 'heartbeat-pull')}"
            log.info("heartbeats at %s (PUB) %s (PULL): %s", *self.addresses.split(), self._listener.security)
        else:
            sub, pull = addresses.split()
            self._in.setsockopt(zmq.SUBSCRIBE, b"")
            connect(self._in, sub, secret, "heartbeat")
            connect(self._out, pull, secret, "heartbeat")
            self.addresses = addresses
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(LivenessMessage)
        self._stop = threading.Event()
        self._abort_reason: str | None = None
        self.failed: str | None = None
        """Why this rank's world is broken, once it is."""
        self._thread = threading.Thread(target=self._run, name=f"meshserve-heartbeat-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def abort(self, reason: str) -> None:
        """(Driver) tell every rank to stop, from any thread."""
        self._abort_reason = reason

    def _run(self) -> None:
        watched = set(range(1, self.world_size)) if self.rank == 0 else {0}
        started = time.monotonic()
        last_seen = {r: started for r in watched}
        beat = self._auth.seal(self._encoder.encode(Heartbeat(self.rank, self.session)))
        try:
            while not self._stop.is_set():
                if self._abort_reason is not None and self.rank == 0:
                    for _ in range(3):  # PUB drops nothing once subscribed; repeat against a late joiner
                        self._out.send(self._auth.seal(self._encoder.encode(Abort(self._abort_reason, self.session))))
                    self._abort_reason = None
                self._out.send(beat)
                deadline = time.monotonic() + self.interval
                while (wait := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                    if not self._in.poll(int(wait * 1000) + 1):
                        continue
                    frame = self._auth.open(self._in.recv())
                    if frame is None:
                        self._dropped("rank %d: dropped an unauthenticated liveness frame", self.rank)
                        continue
                    try:
                        msg = self._decoder.decode(frame)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        self._dropped("rank %d: dropped an undecodable liveness frame", self.rank)
                        continue
                    if msg.session != self.session:
                        continue
                    if isinstance(msg, Abort):
                        self._fail(f"the driver aborted: {msg.reason}")
                    elif msg.rank in last_seen:
                        last_seen[msg.rank] = time.monotonic()
                now = time.monotonic()
                silent = sorted(r for r, t in last_seen.items() if now - t > self.deadline)
                if silent and self.failed is None:
                    who = "the driver (rank 0)" if silent == [0] else f"rank{'s' if len(silent) > 1 else ''} " \
                        + ", ".join(map(str, silent))
                    self._fail(f"{who} sent no heartbeat for {self.deadline:.0f} s")
        finally:
            self._close()

    def _close(self) -> None:
        self._out.close()
        self._in.close()
        if self._listener is not None:
            self._listener.close()
        self._ctx.term()

    def _fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            log.error("rank %d: %s", self.rank, reason)
            self.on_failure(reason)

    def stop(self) -> None:
        """Stop the thread, which closes the sockets (or close them here if it never started)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        elif self._thread.ident is None:
            self._close()
