"""The registration socket of a `meshserve router`: replicas started by their own launchers
join (comm/membership.py), beat, and leave; the router's front door hears of each as it
hears of its own replicas (ReplicaUp, ReplicaLeaving, ReplicaDown in its inbox). A replica
whose beats stop for router.heartbeat_timeout is dropped (its requests move to others); one
that joins again under its name, after its launcher restarted it, takes its place again.

The socket is a ROUTER, CURVE-encrypted with keys derived from server.secret (a process
without the secret cannot connect), and every frame is sealed with the secret too. It runs
on a thread of its own; `stop(replica)` (the admin API's drain) is handed to it through a
queue, as nothing else touches its socket."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import zmq

from meshserve.comm.auth import DropLog, FrameAuth
from meshserve.comm.curve import CurveAuthenticator, make_curve_server
from meshserve.comm.membership import Join, Leave, Refused, StopReplica, Welcome, router_decoder
from meshserve.engine.serving.replicas.admin import AdminError
from meshserve.engine.serving.replicas.replica_states import ReplicaDown, ReplicaLeaving, ReplicaUp

log = logging.getLogger("meshserve")

PURPOSE = "join"
POLL_MS = 100


@dataclass
class _Member:
    index: int
    identity: bytes
    last_seen: float
    up: bool = True


@dataclass(frozen=True)
class Expected:
    """What a replica must serve to join: the router's own model."""

    model: str
    vocab_size: int
    max_model_len: int


class Membership:
    def __init__(self, listen: str, secret: str, expected: Expected, post: Callable[[object], None],
                 heartbeat_interval: float, heartbeat_timeout: float,
                 on_join: Callable[[int, Join], None] = lambda index, join: None):
        """`post(event)`: to the front door's inbox; `on_join(index, join)`: a replica joined
        (before the front door hears it)."""
        self.expected, self.post, self.on_join = expected, post, on_join
        self.interval, self.timeout = heartbeat_interval, heartbeat_timeout
        self._ctx = zmq.Context()
        self._curve = CurveAuthenticator(self._ctx, secret)
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        make_curve_server(self._socket, secret, PURPOSE, self._curve)
        self._socket.bind(listen)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._frames = FrameAuth(secret, PURPOSE)
        self._dropped = DropLog(log)
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), router_decoder()
        self.members: dict[str, _Member] = {}
        self._next = 0
        self._stops: queue.Queue[tuple[int, str]] = queue.Queue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshserve-membership", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    def indices(self) -> set[int]:
        return {m.index for m in list(self.members.values())}

    def stop(self, replica: int, reason: str) -> None:
        """Ask replica `replica` to drain and exit."""
        self._stops.put((replica, reason))

    def close(self) -> None:
        self._closing.set()
        self._thread.join(5)
        self._socket.close(linger=0)
        self._curve.close()
        self._ctx.term()

    # ------------------------------------------------------------------ its thread

    def _run(self) -> None:
        while not self._closing.is_set():
            if self._socket.poll(POLL_MS):
                while True:
                    try:
                        identity, frame = self._socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:  # not two frames: not one of ours
                        continue
                    self._on_frame(identity, frame)
            self._send_stops()
            self._check_beats()

    def _on_frame(self, identity: bytes, frame: bytes) -> None:
        payload = self._frames.open(frame)
        if payload is None:
            self._dropped("registration: dropped a frame not sealed with server.secret")
            return
        try:
            message = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._dropped("registration: dropped a frame that does not decode (%s)", e)
            return
        if isinstance(message, Join):
            self._on_join(identity, message)
            return
        member = self.members.get(message.name)
        if member is None or not member.up:
            self._send(identity, Refused(f"router does not know {message.name!r} (it started again): join again",
                                         rejoin=True))
            return
        member.last_seen, member.identity = time.monotonic(), identity
        if isinstance(message, Leave):
            if message.done:
                member.up = False
                self.post(ReplicaDown(member.index, "it left: its server stopped", expected=True))
            else:
                self.post(ReplicaLeaving(member.index, "it is draining (its server was told to stop)"))

    def _on_join(self, identity: bytes, join: Join) -> None:
        e = self.expected
        wrong = [f"{what} {theirs} (the router's: {ours})" for what, theirs, ours in
                 (("model", join.model, e.model), ("vocab_size", join.vocab_size, e.vocab_size)) if theirs != ours]
        if join.max_model_len < e.max_model_len:  # the router admits prompts by its own
            wrong.append(f"max_model_len {join.max_model_len} (the router admits up to {e.max_model_len})")
        if wrong:
            log.error("replica %r at %s may not join: it serves %s", join.name, join.zmq, "; ".join(wrong))
            self._send(identity, Refused(f"this router serves another model: yours has {'; '.join(wrong)}"))
            return
        member = self.members.get(join.name)
        if member is None:
            member = self.members[join.name] = _Member(self._next, identity, time.monotonic())
            self._next += 1
        elif member.up:  # it started again before its beats were missed
            self.post(ReplicaDown(member.index, "it joined again: it restarted"))
        member.identity, member.last_seen, member.up = identity, time.monotonic(), True
        log.info("replica %d joined: %r at %s (%d rank%s)", member.index, join.name, join.zmq, join.world_size,
                 "" if join.world_size == 1 else "s")
        self.on_join(member.index, join)
        self.post(ReplicaUp(member.index, join.zmq, join.name))
        self._send(identity, Welcome(member.index, self.interval))

    def _check_beats(self) -> None:
        now = time.monotonic()
        for name, member in self.members.items():
            if member.up and now - member.last_seen > self.timeout:
                member.up = False
                self.post(ReplicaDown(member.index, f"its heartbeat stopped for {self.timeout:g} s "
                                                    f"(router.heartbeat_timeout)"))

    def _send_stops(self) -> None:
        while True:
            try:
                replica, reason = self._stops.get_nowait()
            except queue.Empty:
                return
            member = next((m for m in self.members.values() if m.index == replica and m.up), None)
            if member is not None:
                self._send(member.identity, StopReplica(reason))

    def _send(self, identity: bytes, message) -> None:
        try:
            self._socket.send_multipart([identity, self._frames.seal(self._encoder.encode(message))], zmq.NOBLOCK)
        except zmq.Again:  # the replica's queue is full: it is gone or stuck, and its beats will say so
            pass


class MembershipControl:
    """The admin API's ReplicaControl for replicas that joined: their own launchers start
    them, so the router can only ask one to drain and exit."""

    def __init__(self, membership: Membership):
        self.membership = membership

    def manages(self, replica: int) -> bool:
        return replica in self.membership.indices()

    def refuses(self, op: str, replica: int | None) -> str | None:
        if op in ("drain", "remove"):
            return None
        what = "add one" if op == "add" else f"restart replica {replica}"
        return f"replicas join this router from their own launchers: {what} there"

    def stop(self, replica: int, then: str, sets: list[str] | None) -> None:
        self.membership.stop(replica, f"{'removed' if then == 'remove' else 'drained'} by the router's admin API")

    def start(self, replica: int, sets: list[str] | None) -> None:
        raise AdminError(409, self.refuses("restart", replica))

    def add(self, replica: int, sets: list[str]) -> None:
        raise AdminError(409, self.refuses("add", None))
