"""What both clients (sync.py, aio.py) say and hear on their DEALER socket: frames sealed
with the shared secret or not, CURVE's set-up, and which message ends a request."""

from __future__ import annotations

import msgspec
import zmq

from meshserve.client.errors import MeshserveError
from meshserve.comm.auth import FrameAuth
from meshserve.comm.curve import make_curve_client
from meshserve.comm.messages import AbortRequest, Delta, ErrorReply, GenerateRequest, encoder, server_decoder


class Wire:
    def __init__(self, secret: str | None, curve: bool):
        if curve and secret is None:
            raise ValueError("curve=True needs the server's secret: the CURVE keys are derived from it")
        self.secret, self.curve = secret, curve
        self._auth = FrameAuth(secret, "client")
        self._encoder, self._decoder = encoder(), server_decoder()

    def setup(self, sock: zmq.Socket) -> None:
        """Before connecting `sock`. IMMEDIATE: a request is queued only on a connection that
        completed its handshake, so `sock` is writable (POLLOUT) only once a server answers,
        which is what the clients' connect timeout waits for."""
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.curve:
            make_curve_client(sock, self.secret, "client")

    def request(self, req: GenerateRequest) -> bytes:
        return self._auth.seal(self._encoder.encode(req))

    def abort(self, request_id: str) -> bytes:
        return self._auth.seal(self._encoder.encode(AbortRequest(request_id)))

    def read(self, frame: bytes) -> Delta | ErrorReply:
        """The server's message in `frame`. A frame that does not open with the client's secret
        is accepted only as an unsealed ErrorReply (the server refusing a frame it could not
        authenticate: it can fail a request, never deliver output); anything else becomes an
        "unauthorized" ErrorReply for every request in flight."""
        payload = self._auth.open(frame)
        if payload is not None:
            return self._decoder.decode(payload)
        try:
            msg = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            msg = None
        if isinstance(msg, ErrorReply):
            return msg
        return ErrorReply(None, "unauthorized", "a reply from the server failed authentication: the client's "
                                                "secret differs from the server's (server.secret)")


def check_new(request_id: str, in_flight) -> None:
    if request_id in in_flight:
        raise MeshserveError("duplicate_id", f"request_id {request_id!r} is already in flight on this client",
                             request_id)


def ends(msg: Delta | ErrorReply) -> bool:
    """Whether `msg` is its request's last message (a final delta, or an error)."""
    return isinstance(msg, ErrorReply) or msg.finish_reason is not None


def delivered(msg: Delta | ErrorReply) -> Delta:
    """`msg` for the caller: a Delta, or the error raised as MeshserveError."""
    if isinstance(msg, ErrorReply):
        raise MeshserveError(msg.code, msg.message, msg.request_id)
    return msg
