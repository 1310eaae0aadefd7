"""The control plane between the driver and the other ranks, over ZeroMQ.

driver  --PUB  (StepPlan, Shutdown, Hello)-->  SUB   every other rank
driver  <-PULL (StepResult, Ready)----------   PUSH  every other rank

The driver binds both sockets (comm/endpoints.py: unix sockets in a private directory on
one node; TCP ephemeral ports, CURVE-encrypted with a secret, across nodes) and tells the
ranks where they are with a tensor broadcast over the world's gloo group (torch.distributed
carries tensors only). Start-up handshake: the driver publishes Hello until every rank has
answered Ready, so no SUB socket can miss the first plan (PUB/SUB's slow-joiner problem).
High-water marks are unlimited: plans are never dropped.

With a shared secret (server.secret) every frame also carries an HMAC tag (comm/auth.py).
Whatever reaches the driver's PULL socket is checked before it counts: a frame that does
not open with the secret, or does not decode, is dropped with a (rate-limited) warning; so
is a step result that is not the answer the sampling rank owes to a step in flight
(comm/step_results.py), and the driver goes on. The SUB socket of a rank hears only the
driver's PUB.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable

import msgspec
import torch
import torch.distributed as dist
import zmq

from meshserve.comm.auth import DropLog, FrameAuth
from meshserve.comm.endpoints import Listener, connect
from meshserve.comm.messages import (ControlMessage, Hello, RankStats, Ready, StepResult, control_decoder,
                                     encoder, rank_decoder)
from meshserve.comm.step_results import ExpectedResult

ADDRESS_BYTES = 512
MAX_RANK_FRAME_BYTES = 64 << 20
"""ZeroMQ drops a connection to the driver's PULL socket that sends a larger frame (a step
result of thousands of sequences with logprobs is a few MiB)."""
POLL_SLICE_MS = 100

log = logging.getLogger(__name__)


class ControlPlaneError(RuntimeError):
    pass


def broadcast_text(text: str | None, src: int = 0, group=None) -> str:
    """Broadcasts a short string from global rank `src` as a uint8 tensor (no pickling)."""
    buf = torch.zeros(ADDRESS_BYTES, dtype=torch.uint8)
    if text is not None:
        data = text.encode()
        if len(data) > ADDRESS_BYTES:
            raise ValueError(f"{len(data)} bytes exceed the {ADDRESS_BYTES}-byte broadcast buffer")
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf[buf != 0].tolist()).decode()


def all_gather_text(text: str, group=None) -> list[str]:
    """All-gathers a short string from every rank of `group` as uint8 tensors (no pickling);
    returns them in rank order."""
    data = text.encode()
    if len(data) > ADDRESS_BYTES:
        raise ValueError(f"{len(data)} bytes exceed the {ADDRESS_BYTES}-byte gather buffer")
    buf = torch.zeros(ADDRESS_BYTES, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, buf, group=group)
    return [bytes(p[p != 0].tolist()).decode() for p in parts]


class DriverChannel:
    """The driver's end: binds on `host` (the address the other ranks reach the driver at)
    or, with every rank on this node, in `ipc_dir` (a private directory; comm/endpoints.py)."""

    def __init__(self, world_size: int, secret: str | None = None, *, host: str | None = None,
                 ipc_dir: str | None = None):
        self.world_size = world_size
        self.session = uuid.uuid4().hex
        self._ctx = zmq.Context()
        self._listener = Listener(self._ctx, "control", secret, host=socket.gethostbyname(host) if host else None,
                                  ipc_dir=ipc_dir)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._pub.setsockopt(zmq.LINGER, 2000)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_RANK_FRAME_BYTES)
        self.addresses = " ".join((self._listener.bind(self._pub, "control-pub"),
                                   self._listener.bind(self._pull, "control-pull")))
        log.info("control plane at %s (PUB) %s (PULL): %s%s", *self.addresses.split(), self._listener.security,
                 ", frames authenticated" if secret else "")
        self._auth = FrameAuth(secret, "control")
        self._dropped = DropLog(log)
        self._misfits = DropLog(log)
        """Results that fit no step in flight: warned apart, so a flood of garbage does not hide them."""
        self._encoder, self._decoder = encoder(), rank_decoder()
        self.rank_stats: dict[int, RankStats] = {}
        """The latest counters of each other rank."""
        self._expected: dict[int, ExpectedResult] = {}
        """Steps in flight whose result comes from the sampling rank, by step id."""
        self._results: dict[int, StepResult] = {}
        """Their results, once taken in (at most one per step in flight)."""

    def handshake(self, timeout: float) -> None:
        waiting = set(range(1, self.world_size))
        hello = self._auth.seal(self._encoder.encode(Hello(self.session)))
        deadline = time.monotonic() + timeout
        while waiting:
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"control-plane handshake: no Ready from ranks {sorted(waiting)} "
                                        f"within {timeout:.0f} s")
            self._pub.send(hello)
            if self._pull.poll(20):
                msg = self._decode(self._pull.recv())
                if isinstance(msg, Ready) and msg.session == self.session:
                    waiting.discard(msg.rank)

    def publish(self, msg: ControlMessage) -> None:
        self._pub.send(self._auth.seal(self._encoder.encode(msg)))

    def expect(self, expected: ExpectedResult) -> None:
        """The sampling rank owes the result of step `expected.step_id`; only a result that
        fits `expected` is taken in for it."""
        self._expected[expected.step_id] = expected

    def recv_result(self, step_id: int, timeout: float, check: Callable[[], None] | None = None) -> StepResult:
        """The result of step `step_id` (announced with `expect`); `check()` runs every
        POLL_SLICE_MS while waiting (it raises to give up, e.g. once a rank is known dead)."""
        if step_id not in self._expected and step_id not in self._results:
            raise ControlPlaneError(f"step {step_id}: no result is expected")
        deadline = time.monotonic() + timeout
        while step_id not in self._results:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"no result for step {step_id} from the sampling rank within {timeout:.0f} s")
            if self._pull.poll(POLL_SLICE_MS):
                self._take(self._pull.recv())
        return self._results.pop(step_id)

    def drain(self) -> None:
        """Take in whatever the ranks have sent, without waiting (results are kept for
        recv_result; stats update rank_stats)."""
        while self._pull.poll(0):
            self._take(self._pull.recv())

    def _take(self, frame: bytes) -> None:
        msg = self._decode(frame)
        if isinstance(msg, StepResult):
            self._take_result(msg)
        elif isinstance(msg, RankStats) and 0 < msg.rank < self.world_size:
            self.rank_stats[msg.rank] = msg

    def _take_result(self, result: StepResult) -> None:
        expected = self._expected.get(result.step_id)
        problem = "no result for that step is in flight" if expected is None else expected.problem(result)
        if problem is not None:
            self._misfits("dropped a step result for step %d that the sampling rank did not send: %s "
                          "(a peer without server.secret reached the driver's PULL socket?)", result.step_id, problem)
            return
        del self._expected[result.step_id]
        self._results[result.step_id] = result

    def _decode(self, frame: bytes):
        """The message of a frame from a rank, or None (dropped, with a warning) if it does not
        authenticate or decode: anyone who reaches the PULL socket can send one."""
        payload = self._auth.open(frame)
        if payload is None:
            self._dropped("dropped an unauthenticated control-plane frame (%d bytes): a peer without "
                          "server.secret, or with another one, reached the driver's PULL socket", len(frame))
            return None
        try:
            return self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._dropped("dropped an undecodable control-plane frame (%d bytes): %s", len(frame), e)
            return None

    def close(self) -> None:
        self._pub.close()
        self._pull.close()
        self._listener.close()
        self._ctx.term()


class WorkerChannel:
    """A non-driver rank's end."""

    def __init__(self, addresses: str, rank: int, secret: str | None = None):
        pub_address, pull_address = addresses.split()
        self.rank = rank
        self._auth = FrameAuth(secret, "control")
        self._dropped = DropLog(log)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        connect(self._sub, pub_address, secret, "control")
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 2000)
        connect(self._push, pull_address, secret, "control")
        self._encoder, self._decoder = encoder(), control_decoder()

    def handshake(self, timeout: float) -> None:
        msg = self.recv(timeout, skip_hello=False)
        if not isinstance(msg, Hello):
            raise ControlPlaneError(f"rank {self.rank}: expected Hello first, got {type(msg).__name__}")
        self.session = msg.session
        self._push.send(self._auth.seal(self._encoder.encode(Ready(self.rank, msg.session))))

    def recv(self, timeout: float | None = None, skip_hello: bool = True) -> ControlMessage:
        while True:
            if timeout is not None and not self._sub.poll(int(timeout * 1000)):
                raise ControlPlaneError(f"rank {self.rank}: nothing from the driver within {timeout:.0f} s")
            frame = self._auth.open(self._sub.recv())
            if frame is None:
                self._dropped("rank %d: dropped an unauthenticated control-plane frame (is server.secret the same "
                              "on every node?)", self.rank)
                continue
            try:
                msg = self._decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise ControlPlaneError(f"rank {self.rank}: undecodable control-plane frame: {e}") from None
            if not (skip_hello and isinstance(msg, Hello)):
                return msg

    def send_result(self, result: StepResult) -> None:
        self._push.send(self._auth.seal(self._encoder.encode(result)))

    def send_stats(self, stats: RankStats) -> None:
        self._push.send(self._auth.seal(self._encoder.encode(stats)))

    def close(self) -> None:
        self._sub.close()
        self._push.close()
        self._ctx.term()
