"""asyncio ZMQ client: any number of concurrent requests over one DEALER socket; a
reader task routes each reply to the request it belongs to."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import zmq
import zmq.asyncio

from meshserve.client.errors import RequestTimeout, ServerUnreachable
from meshserve.client.frames import Wire, check_new, delivered, ends
from meshserve.client.request import make_request
from meshserve.comm.messages import Completion, Delta


class AsyncClient:
    def __init__(self, address: str = "tcp://127.0.0.1:5555", timeout: float | None = 300.0,
                 secret: str | None = None, curve: bool = False, connect_timeout: float | None = 10.0):
        """As Client: `timeout` per message of a reply, `secret` and `curve` as the
        server's, `connect_timeout` for a connection to the server."""
        self.address, self.timeout, self.connect_timeout = address, timeout, connect_timeout
        self._wire = Wire(secret, curve)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._wire.setup(self._sock)
        self._sock.connect(address)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def generate(self, prompt: str | Sequence[int], *, stream: bool = False, timeout: float | None = None,
                       request_id: str | None = None, **params) -> Completion | AsyncIterator[Delta]:
        """As Client.generate; with stream=True, `await` returns an async iterator of Deltas."""
        req = make_request("AsyncClient.generate", prompt, request_id=request_id, stream=stream, params=params)
        check_new(req.request_id, self._queues)
        wait = None if self.connect_timeout is None else int(self.connect_timeout * 1000)
        if not await self._sock.poll(wait, zmq.POLLOUT):
            raise ServerUnreachable(self.address, self.connect_timeout)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        self._queues[req.request_id] = asyncio.Queue()
        await self._sock.send(self._wire.request(req))
        deltas = self._deltas(req.request_id, self.timeout if timeout is None else timeout)
        if stream:
            return deltas
        completion = Completion(req.request_id)
        async for delta in deltas:
            completion.add(delta)
        return completion

    async def abort(self, request_id: str) -> None:
        """Ask the server to stop `request_id`. Never blocks: with no server connected (it is
        down, or refused the handshake) there is nothing to stop."""
        try:
            await self._sock.send(self._wire.abort(request_id), zmq.NOBLOCK)
        except zmq.Again:
            pass

    async def _deltas(self, request_id: str, timeout: float | None) -> AsyncIterator[Delta]:
        queue = self._queues[request_id]
        finished = False
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(queue.get(), timeout)
                except asyncio.TimeoutError:
                    raise RequestTimeout(request_id, timeout, self.address) from None
                finished = ends(msg)
                yield delivered(msg)
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def _read_loop(self) -> None:
        while True:
            msg = self._wire.read(await self._sock.recv())
            if msg.request_id is None:  # an error for a frame the server could not read: tell everyone
                for q in self._queues.values():
                    q.put_nowait(msg)
            elif msg.request_id in self._queues:
                self._queues[msg.request_id].put_nowait(msg)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
