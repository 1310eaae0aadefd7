"""What the ZMQ clients say when the caller or the network is wrong, with real sockets: no
server at the address is ServerUnreachable within the connect timeout, naming the address
(and the same client works once a server binds there); a misspelt or mistyped keyword fails
at the call, named as the caller wrote it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from meshserve.client import AsyncClient, Client, ServerUnreachable
from meshserve.comm.messages import Delta, Usage
from meshserve.engine.serving.commands import AddCommand, Inbox
from meshserve.engine.serving.zmq_frontend import ZmqFrontend
from support.server import free_port


def test_no_server_is_unreachable_within_the_connect_timeout_and_a_later_server_is_reached():
    address = f"tcp://127.0.0.1:{free_port()}"
    with Client(address, connect_timeout=0.5) as c:
        started = time.monotonic()
        with pytest.raises(ServerUnreachable, match=f"at {address} within 0.5 s") as err:
            c.generate("hi", max_tokens=1)
        assert time.monotonic() - started < 5 and err.value.code == "unreachable"
        inbox = Inbox()
        front = ZmqFrontend(address, inbox, None, vocab_size=1000, max_model_len=64)
        front.start()
        try:
            def serve_one():
                cmd = inbox.get(timeout=30)
                assert isinstance(cmd, AddCommand)
                front.send(cmd.key, Delta(cmd.request_id, "ok", [7], "stop", usage=Usage(len(cmd.prompt_ids), 1)))

            step_loop = threading.Thread(target=serve_one, daemon=True)
            step_loop.start()
            c.connect_timeout = 30
            assert c.generate([1, 2], max_tokens=1).text == "ok"
            step_loop.join(30)
        finally:
            front.close()


def test_the_async_client_is_unreachable_too():
    address = f"tcp://127.0.0.1:{free_port()}"

    async def main():
        async with AsyncClient(address, connect_timeout=0.5) as c:
            await c.generate("hi", max_tokens=1)

    with pytest.raises(ServerUnreachable, match=address):
        asyncio.run(main())


@pytest.mark.parametrize("make", [lambda a: Client(a), lambda a: AsyncClient(a)], ids=["sync", "async"])
def test_keywords_are_checked_at_the_call_and_named_as_written(make):
    client = make(f"tcp://127.0.0.1:{free_port()}")
    caller = f"{type(client).__name__}.generate"

    def call(*args, **kwargs):
        out = client.generate(*args, **kwargs)
        return asyncio.run(out) if asyncio.iscoroutine(out) else out

    with pytest.raises(TypeError, match=rf"{caller}\(\) got an unexpected keyword argument 'max_token' "
                                        r"\(did you mean 'max_tokens'\?\)"):
        call("hi", max_token=5)
    with pytest.raises(ValueError, match=rf"{caller}\(\): max_tokens: Expected `int`, got `str`"):
        call("hi", max_tokens="5")
    with pytest.raises(ValueError, match=rf"{caller}\(\): temperature: Expected `float` >= 0.0"):
        call("hi", temperature=-1)
    with pytest.raises(TypeError, match="a string or a sequence of token ids"):
        call([1, "a"])
    if isinstance(client, AsyncClient):
        asyncio.run(client.close())
    else:
        client.close()
