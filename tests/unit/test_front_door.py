"""The front door's loop (engine/serving/replicas/front_door.py) over real ZMQ sockets: two
ROUTER sockets stand where two replicas' ZMQ frontends would, and answer what the test
tells them. A request whose replica refuses it or fails before any output starts over on
the other replica; one that had output gets `unavailable` naming its replica; replies reach
the client under its own request id; aborts reach the replica; /health follows."""

from __future__ import annotations


import pytest

from meshserve.comm.messages import AbortRequest, Delta, ErrorReply, GenerateRequest, Usage
from meshserve.engine.serving.commands import AbortCommand
from meshserve.engine.serving.replicas.front_door import ReplicaDown
from support.fake_replicas import add, running_front_door


@pytest.fixture
def door():
    with running_front_door(2) as parts:
        yield parts


def test_a_refused_request_starts_over_on_the_other_replica_under_its_own_id(door):
    front, inbox, client, replicas = door
    key = add(inbox, "mine", list(range(20)))
    sent = replicas[0].receive()  # least loaded, fewest routed: replica 0
    assert isinstance(sent, GenerateRequest) and sent.prompt_token_ids == list(range(20))
    replicas[0].reply(ErrorReply(sent.request_id, "overloaded", "4096 requests are waiting"))
    again = replicas[1].receive()
    assert again.prompt_token_ids == list(range(20)) and again.request_id != sent.request_id
    replicas[1].reply(Delta(again.request_id, "a", [7]))
    replicas[1].reply(Delta(again.request_id, "b", [8], "length", usage=Usage(20, 2)))
    got = client.wait(2)
    assert [(k, m.request_id, m.token_ids) for k, m in got] == [(key, "mine", [7]), (key, "mine", [8])]
    assert front.router.load(0) == front.router.load(1) == 0
    assert replicas[0].quiet()


def test_a_failed_replica_fails_what_had_output_and_moves_what_had_none(door):
    front, inbox, client, replicas = door
    key_a = add(inbox, "a", list(range(10)))
    a = replicas[0].receive()
    key_b = add(inbox, "b", list(range(30, 40)))
    b = replicas[1].receive()
    replicas[1].reply(Delta(b.request_id, "x", [5]))  # b has output on replica 1; a has none on 0
    client.wait(1)
    key_c = add(inbox, "c", list(range(50, 60)))
    c = replicas[0].receive()  # replica 0 holds 10 tokens, replica 1 11
    inbox.put(ReplicaDown(0, "exit code 1: rank 1 died first (killed by SIGKILL)"))
    moved = {replicas[1].receive().prompt_token_ids[0], replicas[1].receive().prompt_token_ids[0]}
    assert moved == {0, 50}  # a and c start over on replica 1
    assert front.health() == (200, {"status": "degraded", "replicas": {"total": 2, "serving": 1, "down": [
        {"replica": 0, "reason": "exit code 1: rank 1 died first (killed by SIGKILL)"}]}})
    inbox.put(ReplicaDown(1, "exit code 1: rank 0 died first (killed by SIGKILL)"))
    got = client.wait(4)[1:]
    errors = {k.request_id: m for k, m in got}
    assert set(errors) == {"a", "b", "c"} and all(isinstance(m, ErrorReply) for m in errors.values())
    assert errors["b"].code == "unavailable" and errors["b"].message.startswith("replica 1 failed: exit code 1")
    assert front.health()[0] == 503 and front.health()[1]["status"] == "failed"
    assert key_a != key_b != key_c and a.request_id != c.request_id


def test_an_abort_reaches_the_replica_and_its_last_delta_the_client(door):
    front, inbox, client, replicas = door
    key = add(inbox, "long", list(range(10)))
    sent = replicas[0].receive()
    inbox.put(AbortCommand(key))
    abort = replicas[0].receive()
    assert isinstance(abort, AbortRequest) and abort.request_id == sent.request_id
    add(inbox, "long", list(range(5)))  # the same client's id while it runs: refused, as by one replica
    (_, refused), = client.wait(1)
    assert isinstance(refused, ErrorReply) and refused.code == "duplicate_id"
    replicas[0].reply(Delta(sent.request_id, "", [], "abort", usage=Usage(10, 0)))
    (_, last), = client.wait(2)[1:]
    assert last.finish_reason == "abort" and last.request_id == "long"
    assert front.router.requests(0) == 0 and replicas[1].quiet()
