"""uvicorn's HTTP/1.1 protocol (h11) with the limits a public server needs:

- at most `max_connections` open connections: one more gets a 503 and is closed at once;
- a client has `header_timeout` seconds to send a request's headers, from when it connects
  or its previous response ended (a slow or idle client cannot hold a connection forever;
  the body has its own timeout, in the ASGI app);
- a request h11 cannot parse gets a 400 in OpenAI's error shape, not plain text.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from meshserve.engine.serving.openai_protocol import OpenAIError


def error_body(status: int, message: str, type_: str, code: str) -> bytes:
    """OpenAI's error body (openai_protocol.OpenAIError's shape), encoded."""
    return json.dumps(OpenAIError(status, message, type_, code=code).body()).encode()


def raw_response(status: int, reason: str, body: bytes) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers given before h11 has
    a request to answer."""
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode() + body


class LimitedH11Protocol(H11Protocol):
    max_connections = 1024
    header_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            body = error_body(503, f"the server has {self.max_connections} connections open, its limit "
                                   f"(server.http_limits.max_connections); retry later", "service_unavailable_error",
                              "too_many_connections")
            transport.write(raw_response(503, "Service Unavailable", body))
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:  # the headers are in
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def send_400_response(self, msg: str) -> None:
        body = error_body(400, f"malformed HTTP request: {msg}", "invalid_request_error", "invalid_http_request")
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 is past the point of answering: a raw response
            self.transport.write(raw_response(400, "Bad Request", body))
        self.transport.close()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        body = error_body(408, f"no complete request headers within {self.header_timeout:g} s "
                               f"(server.http_limits.read_timeout)", "invalid_request_error", "request_timeout")
        self.transport.write(raw_response(408, "Request Timeout", body))
        self.transport.close()


def limited_protocol(max_connections: int, header_timeout: float) -> type[LimitedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,),
                {"max_connections": max_connections, "header_timeout": header_timeout})
