"""The front door's connection to one replica's driver: a DEALER socket to the replica's
ZMQ frontend, speaking the client protocol (comm/messages.py), frames sealed with the
shared secret (and CURVE, with server.curve) as any client's. Owned by the front door's
loop thread; nothing here blocks."""

from __future__ import annotations

import logging

import msgspec
import zmq

from meshserve.comm.auth import FrameAuth
from meshserve.comm.curve import make_curve_client
from meshserve.comm.messages import AbortRequest, Delta, ErrorReply, GenerateRequest, encoder, server_decoder

log = logging.getLogger(__name__)

SEND_HIGH_WATER = 0
"""No limit on queued requests: the replica's admission bounds them (its replies say
`overloaded`), and a send must never block the front door's loop."""


class ReplicaLink:
    def __init__(self, ctx: zmq.Context, index: int, address: str, secret: str | None = None, curve: bool = False):
        self.index, self.address = index, address
        self._auth = FrameAuth(secret, "client")
        self._encoder, self._decoder = encoder(), server_decoder()
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        if curve:
            make_curve_client(self.socket, secret, "client")
        self.socket.connect(address)

    def send(self, request: GenerateRequest) -> None:
        self.socket.send(self._auth.seal(self._encoder.encode(request)), zmq.NOBLOCK)

    def abort(self, request_id: str) -> None:
        self.socket.send(self._auth.seal(self._encoder.encode(AbortRequest(request_id))), zmq.NOBLOCK)

    def receive(self) -> list[Delta | ErrorReply]:
        """Every reply that has arrived (none: an empty list)."""
        out = []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            payload = self._auth.open(frame)
            try:
                out.append(self._decoder.decode(payload if payload is not None else frame))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("replica %d sent a frame that does not decode (%s): dropped", self.index, e)

    def close(self) -> None:
        self.socket.close(linger=0)
