"""Stand-ins for the front door's neighbours over real ZMQ sockets: a frontend that records
what its clients would get, and ROUTER sockets where replicas' ZMQ frontends would be."""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

from meshserve.comm.messages import SamplingParams, client_decoder, encoder
from meshserve.engine.serving.commands import AddCommand, RequestKey

TIMEOUT = 10.0


class Client:
    """Stands for a frontend: what the front door sends its clients."""

    tag = "zmq"

    def __init__(self):
        self.accepting, self.error = True, None
        self.got: list[tuple[RequestKey, msgspec.Struct]] = []
        self.lock = threading.Lock()

    def start(self):
        pass

    def send(self, key, message):
        with self.lock:
            self.got.append((key, message))

    def send_all(self, replies):
        for key, message in replies:
            self.send(key, message)

    def close(self):
        pass

    def wait(self, n: int) -> list[tuple[RequestKey, msgspec.Struct]]:
        deadline = time.monotonic() + TIMEOUT
        while len(self.got) < n:
            assert time.monotonic() < deadline, f"only {self.got}"
            time.sleep(0.01)
        return self.got[:n]


class Replica:
    """A ROUTER socket where a replica's ZMQ frontend would be."""

    def __init__(self, ctx: zmq.Context):
        self.socket = ctx.socket(zmq.ROUTER)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.decoder, self.encoder = client_decoder(), encoder()
        self.peer = None

    def receive(self):
        assert self.socket.poll(int(TIMEOUT * 1000)), "nothing reached the replica"
        self.peer, frame = self.socket.recv_multipart()
        return self.decoder.decode(frame)

    def quiet(self) -> bool:
        return not self.socket.poll(200)

    def reply(self, message) -> None:
        self.socket.send_multipart([self.peer, self.encoder.encode(message)])


def add(inbox, request_id: str, prompt: list[int]) -> RequestKey:
    key = RequestKey("zmq", b"client-1", request_id)
    inbox.put(AddCommand(key, request_id, prompt, SamplingParams(max_tokens=4, temperature=0), True))
    return key
