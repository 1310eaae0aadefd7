"""The front door's loop (engine/serving/replicas/front_door.py) over real ZMQ sockets: two
ROUTER sockets stand where two replicas' ZMQ frontends would, and answer what the test
tells them. A request whose replica refuses it or fails before any output starts over on
the other replica; one that had output moves there with it (Resume) and the client sees
each token once, a whole request answered once; past router.migration_limit, or with no
replica left, `unavailable` naming its replica; a restarted replica takes requests again;
replies reach the client under its own request id; aborts reach the replica; /health
follows."""

from __future__ import annotations

import time

import pytest
import zmq

from meshserve.comm.messages import AbortRequest, Delta, ErrorReply, GenerateRequest, Usage
from meshserve.engine.serving.commands import AbortCommand, RequestKey
from meshserve.engine.serving.replicas.admin import AdminCommand, AdminError
from meshserve.engine.serving.replicas.replica_states import ReplicaDown, ReplicaUp
from support.fake_replicas import Replica, add, running_front_door


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


def test_a_failed_replicas_requests_move_with_their_output_and_it_serves_again_once_restarted(door):
    front, inbox, client, replicas = door
    key_a = add(inbox, "a", list(range(10)))
    a = replicas[0].receive()
    add(inbox, "b", list(range(30, 40)))
    b = replicas[1].receive()
    key_c = add(inbox, "c", list(range(50, 60)), stream=False, max_tokens=9)
    c = replicas[0].receive()  # replica 0 holds 10 tokens, replica 1 10, routed once each: 0
    assert a.stream and b.stream and c.stream  # every request streams to the front door
    replicas[0].reply(Delta(a.request_id, "Hel", [11, 12], logprobs=None))
    replicas[0].reply(Delta(c.request_id, "x", [5]))
    assert [m.token_ids for _, m in client.wait(1)] == [[11, 12]]  # c is whole: nothing yet
    inbox.put(ReplicaDown(0, "exit code 1: rank 1 died first (killed by SIGKILL)", restart_in=1.0))
    moved = {m.prompt_token_ids[0]: m for m in (replicas[1].receive(), replicas[1].receive())}
    assert moved[0].resume.token_ids == [11, 12] and moved[0].resume.text_chars == 3
    assert moved[50].resume.token_ids == [5] and moved[50].resume.text_chars == 1
    status, body = front.health()
    assert status == 200 and body["status"] == "degraded" and body["replicas"]["down"] == [
        {"replica": 0, "reason": "exit code 1: rank 1 died first (killed by SIGKILL)", "state": "restarting"}]
    replicas[1].reply(Delta(moved[0].request_id, "lo", [13], "length", usage=Usage(10, 4)))
    replicas[1].reply(Delta(moved[50].request_id, "yz", [6, 7], "stop", usage=Usage(10, 3)))
    got = client.wait(3)[1:]
    assert [(k, m.token_ids, m.text) for k, m in got] == [(key_a, [13], "lo"), (key_c, [5, 6, 7], "xyz")]
    assert got[1][1].usage == Usage(10, 3) and got[1][1].finish_reason == "stop"

    replicas.append(Replica(zmq.Context.instance()))  # replica 0, started again at another port
    inbox.put(ReplicaUp(0, replicas[2].address))
    deadline = time.monotonic() + 5
    while front.health()[1]["status"] != "ok":
        assert time.monotonic() < deadline, front.health()
        time.sleep(0.01)
    assert front.health()[1]["replicas"]["each"][0] == {"replica": 0, "state": "serving", "restarts": 1}
    add(inbox, "d", list(range(70, 75)))  # replica 1 still holds b: the restarted one takes it
    d = replicas[2].receive()
    assert d.prompt_token_ids == list(range(70, 75)) and d.resume is None
    replicas[2].reply(Delta(d.request_id, "", [1], "length", usage=Usage(5, 1)))
    assert client.wait(4)[3][0] == RequestKey("zmq", b"client-1", "d") and replicas[0].quiet()


def test_a_request_past_its_migration_limit_or_on_the_last_replica_gets_unavailable():
    with running_front_door(2, migration_limit=0) as (front, inbox, client, replicas):
        key = add(inbox, "b", list(range(30, 40)))
        b = replicas[0].receive()
        add(inbox, "e", list(range(40, 45)))
        e = replicas[1].receive()
        replicas[0].reply(Delta(b.request_id, "x", [5]))
        client.wait(1)
        inbox.put(ReplicaDown(0, "killed by SIGKILL"))
        (k, error), = client.wait(2)[1:]
        assert k == key and isinstance(error, ErrorReply) and error.code == "unavailable"
        assert error.message == "replica 0 failed: killed by SIGKILL"
        replicas[1].reply(Delta(e.request_id, "y", [6]))
        client.wait(3)
        inbox.put(ReplicaDown(1, "killed by SIGKILL"))
        assert client.wait(4)[3][1].message == "replica 1 failed: killed by SIGKILL"
        assert front.health()[0] == 503 and front.health()[1]["status"] == "failed"


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


class Control:
    """Stands for the launcher's ReplicaKeeper: records what the admin API asks of it."""

    def __init__(self):
        self.calls = []

    def manages(self, replica):
        return replica < 2

    def refuses(self, op, replica):
        return None

    def stop(self, replica, then, sets):
        self.calls.append(("stop", replica, then, sets))

    def start(self, replica, sets):
        self.calls.append(("start", replica, sets))

    def add(self, replica, sets):
        self.calls.append(("add", replica, sets))


def admin(inbox, op, replica=None, **kwargs):
    cmd = AdminCommand(op, replica, **kwargs)
    inbox.put(cmd)
    return cmd.done.result(5)


def test_a_drained_replica_takes_no_new_requests_and_moves_what_is_left_at_its_timeout(door):
    front, inbox, client, replicas = door
    front.control = control = Control()
    add(inbox, "a", list(range(10)))
    a = replicas[0].receive()
    replicas[0].reply(Delta(a.request_id, "x", [5]))
    client.wait(1)
    assert admin(inbox, "drain", 0, timeout=0.5) == {"replica": 0, "state": "draining"}
    add(inbox, "b", list(range(20, 30)))  # replica 0 drains: b goes to replica 1
    assert replicas[1].receive().prompt_token_ids == list(range(20, 30))
    assert isinstance(replicas[0].receive(), AbortRequest)  # a, at the timeout ...
    moved = replicas[1].receive()  # ... moves with its output
    assert moved.prompt_token_ids == list(range(10)) and moved.resume.token_ids == [5]
    deadline = time.monotonic() + 5
    while not control.calls:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert control.calls == [("stop", 0, "stop", None)]
    listed = admin(inbox, "list")["replicas"]
    assert [(r["replica"], r["state"]) for r in listed] == [(0, "draining"), (1, "serving")]
    assert listed[1]["requests"] == 2
    with pytest.raises(AdminError, match="replica 0 is draining"):
        admin(inbox, "restart", 0)
    with pytest.raises(AdminError, match="no replica 5"):
        admin(inbox, "drain", 5)
    inbox.put(ReplicaDown(0, "stopped by the admin API", expected=True))
    while admin(inbox, "list")["replicas"][0]["state"] != "stopped":
        assert time.monotonic() < deadline
    assert admin(inbox, "restart", 0, sets=["model.dtype=float32"])["state"] == "restarting"
    assert control.calls[-1] == ("start", 0, ["model.dtype=float32"])
    assert admin(inbox, "add", sets=[])["replica"] == 2 and control.calls[-1] == ("add", 2, [])
    assert front.health()[1]["replicas"]["total"] == 3 and front.router.num_replicas == 3
