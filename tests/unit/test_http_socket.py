"""The HTTP frontend's listening socket (engine/serving/http_frontend.py bind_socket): the
connections asyncio accepts on it have Nagle's algorithm off. With it on, a stream's first
event waited in the kernel for the client's ACK of the response headers, which Linux delays
in the middle of an exchange: each streamed request's first token reached the client a
delayed-ACK timeout late."""

from __future__ import annotations

import asyncio
import socket

from meshserve.engine.serving.http_frontend import bind_socket


def test_accepted_connections_send_small_writes_at_once():
    async def accepted_nodelay() -> int:
        sock = bind_socket("127.0.0.1:0")
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        def handler(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handler, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) == 1
