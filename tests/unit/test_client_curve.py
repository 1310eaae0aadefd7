"""server.curve: the client-facing ROUTER socket as a CURVE server, with real sockets on both
sides. Oracles: a client with the secret and curve=True gets its reply; a client without
CURVE, or with another secret, never connects (ServerUnreachable) and starts nothing (the step loop's inbox stays
empty); a config with server.curve and no secret is an error before any rank starts."""

from __future__ import annotations

import queue
import threading

import pytest

from meshserve.client import Client, ServerUnreachable
from meshserve.comm.messages import Delta, Usage
from meshserve.configs import load_config
from meshserve.configs.validate import client_security_problems
from meshserve.engine.serving.commands import AddCommand, Inbox
from meshserve.engine.serving.zmq_frontend import ZmqFrontend
from support.server import free_port

SECRET = "curve-test-secret-0123456789abcdef"


@pytest.fixture
def frontend():
    inbox = Inbox()
    front = ZmqFrontend(f"tcp://127.0.0.1:{free_port()}", inbox, None, vocab_size=1000, max_model_len=64,
                        secret=SECRET, curve=True)
    front.start()
    yield front, inbox
    front.close()


def _serve_one(front: ZmqFrontend, inbox: Inbox) -> AddCommand:
    cmd = inbox.get(timeout=30)
    assert isinstance(cmd, AddCommand)
    front.send(cmd.key, Delta(cmd.request_id, "ok", [7], "stop", usage=Usage(len(cmd.prompt_ids), 1)))
    return cmd


def test_a_curve_client_with_the_secret_is_served(frontend):
    front, inbox = frontend
    served: list[AddCommand] = []
    step_loop = threading.Thread(target=lambda: served.append(_serve_one(front, inbox)), daemon=True)
    step_loop.start()
    with Client(front.address, timeout=30, secret=SECRET, curve=True) as c:
        out = c.generate([1, 2, 3], max_tokens=1)
    step_loop.join(30)
    assert out.text == "ok" and out.finish_reason == "stop" and served[0].prompt_ids == [1, 2, 3]


@pytest.mark.parametrize("kwargs", [{"secret": SECRET}, {"secret": "another secret", "curve": True}, {}])
def test_clients_without_the_curve_keys_reach_nothing(frontend, kwargs):
    front, inbox = frontend
    with Client(front.address, connect_timeout=2, **kwargs) as c:
        with pytest.raises(ServerUnreachable, match=front.address):
            c.generate([1, 2, 3], max_tokens=1)
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.5)


def test_curve_without_a_secret_is_a_config_error():
    config = load_config(None, ["server.curve=true"])
    (problem,) = client_security_problems(config)
    assert "server.secret" in problem
    assert client_security_problems(load_config(None, ["server.curve=true", "server.secret=abc"])) == []
    with pytest.raises(ValueError):
        Client("tcp://127.0.0.1:1", curve=True)
