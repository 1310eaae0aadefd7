"""Reading the server's frames, sealed with the shared secret or not (both clients)."""

from __future__ import annotations

import msgspec

from meshserve.comm.auth import FrameAuth
from meshserve.comm.messages import Delta, ErrorReply


def open_reply(auth: FrameAuth, decoder: msgspec.msgpack.Decoder, frame: bytes) -> Delta | ErrorReply:
    """The server's message in `frame`. A frame that does not open with the client's secret
    is accepted only as an unsealed ErrorReply (the server refusing a frame it could not
    authenticate: it can fail a request, never deliver output); anything else becomes an
    "unauthorized" ErrorReply for every request in flight."""
    payload = auth.open(frame)
    if payload is not None:
        return decoder.decode(payload)
    try:
        msg = decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        msg = None
    if isinstance(msg, ErrorReply):
        return msg
    return ErrorReply(None, "unauthorized", "a reply from the server failed authentication: the client's secret "
                                            "differs from the server's (server.secret)")
