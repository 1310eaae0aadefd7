"""Stand-ins for the front door's neighbours over real ZMQ sockets: a frontend that records
what its clients would get, and ROUTER sockets where replicas' ZMQ frontends would be."""

from __future__ import annotations

import contextlib
import threading
import time

import msgspec
import zmq

from meshserve.comm.messages import SamplingParams, client_decoder, encoder
from meshserve.engine.serving.commands import AddCommand, RequestKey
from meshserve.engine.serving.replicas.front_door import FrontDoor, WakingInbox
from meshserve.engine.serving.replicas.link import ReplicaLink
from meshserve.engine.serving.replicas.routing import Router

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


def add(inbox, request_id: str, prompt: list[int], stream: bool = True, max_tokens: int = 4) -> RequestKey:
    key = RequestKey("zmq", b"client-1", request_id)
    inbox.put(AddCommand(key, request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), stream))
    return key


@contextlib.contextmanager
def running_front_door(num_replicas: int, prefill_replicas: int = 0, migration_limit: int = 3):
    """A FrontDoor running on a thread over `num_replicas` Replica sockets (least-loaded
    routing): yields (front door, its inbox, the Client frontend, the replicas). A replica
    restarted (ReplicaUp) is reached at the address the event names; `replicas.append`
    a Replica there first."""
    ctx = zmq.Context()
    replicas = [Replica(ctx) for _ in range(num_replicas)]
    inbox, client = WakingInbox(), Client()
    links = [ReplicaLink(ctx, i, r.address) for i, r in enumerate(replicas)]
    front = FrontDoor(inbox, [client], links, Router(num_replicas, "least_loaded", 16, 1000),
                      prefill_replicas=prefill_replicas, migration_limit=migration_limit,
                      connect=lambda i, address: ReplicaLink(ctx, i, address))
    loop = threading.Thread(target=front.run, daemon=True)
    loop.start()
    try:
        yield front, inbox, client, replicas
    finally:
        front.request_stop(timeout=0.0)
        loop.join(5)
        for link in links:
            if link is not None:
                link.close()
        for r in replicas:
            r.socket.close(linger=0)
        ctx.term()
