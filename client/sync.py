"""Blocking ZMQ client. One DEALER socket; several requests may be in flight from one
thread (each call reads its own replies and keeps the others'), but a Client is not
shared between threads: use one per thread, or AsyncClient."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Sequence

import zmq

from meshserve.client.errors import MeshserveError, RequestTimeout, ServerUnreachable
from meshserve.client.frames import Wire, check_new, delivered, ends
from meshserve.client.request import make_request
from meshserve.comm.messages import Completion, Delta, ErrorReply


class Client:
    def __init__(self, address: str = "tcp://127.0.0.1:5555", timeout: float | None = 300.0,
                 secret: str | None = None, curve: bool = False, connect_timeout: float | None = 10.0):
        """`timeout`: seconds to wait for each message of a reply before giving up. `secret`:
        the server's shared secret (server.secret), if it has one. `curve`: the server has
        server.curve (CURVE-encrypted connections; needs `secret`). `connect_timeout`:
        seconds a request waits for a connection to the server before ServerUnreachable."""
        self.address, self.timeout, self.connect_timeout = address, timeout, connect_timeout
        self._wire = Wire(secret, curve)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._wire.setup(self._sock)
        self._sock.connect(address)
        self._pending: dict[str, collections.deque] = {}

    def generate(self, prompt: str | Sequence[int], *, stream: bool = False, timeout: float | None = None,
                 request_id: str | None = None, **params) -> Completion | Iterator[Delta]:
        """Generate from a text prompt or token ids. `params`: SamplingParams' fields
        (max_tokens, temperature, top_p, top_k, seed, stop, ...), cache_salt,
        structured_outputs, lora and priority (client/request.py). stream=False returns a Completion; stream=True an iterator of
        Deltas, the last with finish_reason and usage. Raises MeshserveError on an error
        reply, ServerUnreachable when no server is connected within connect_timeout, and
        RequestTimeout (after aborting) when the server stays silent."""
        req = make_request("Client.generate", prompt, request_id=request_id, stream=stream, params=params)
        check_new(req.request_id, self._pending)
        wait = None if self.connect_timeout is None else int(self.connect_timeout * 1000)
        if not self._sock.poll(wait, zmq.POLLOUT):
            raise ServerUnreachable(self.address, self.connect_timeout)
        self._pending[req.request_id] = collections.deque()
        self._sock.send(self._wire.request(req))
        deltas = self._deltas(req.request_id, self.timeout if timeout is None else timeout)
        if stream:
            return deltas
        completion = Completion(req.request_id)
        for delta in deltas:
            completion.add(delta)
        return completion

    def abort(self, request_id: str) -> None:
        """Ask the server to stop `request_id`. Never blocks: with no server connected (it is
        down, or refused the handshake) there is nothing to stop."""
        try:
            self._sock.send(self._wire.abort(request_id), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _deltas(self, request_id: str, timeout: float | None) -> Iterator[Delta]:
        finished = False
        try:
            while True:
                msg = self._next(request_id, timeout)
                finished = ends(msg)
                yield delivered(msg)
                if finished:
                    return
        finally:
            self._pending.pop(request_id, None)
            if not finished:  # the caller stopped reading or timed out: free the server's slot
                self.abort(request_id)

    def _next(self, request_id: str, timeout: float | None) -> Delta | ErrorReply:
        queue = self._pending[request_id]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not queue:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._sock.poll(None if wait is None else int(wait * 1000)):
                raise RequestTimeout(request_id, timeout, self.address)
            msg = self._wire.read(self._sock.recv())
            if msg.request_id is None and isinstance(msg, ErrorReply):
                raise MeshserveError(msg.code, msg.message)
            if msg.request_id in self._pending:
                self._pending[msg.request_id].append(msg)
        return queue.popleft()

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
