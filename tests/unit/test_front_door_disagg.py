"""The front door with disaggregated prefill/decode (replica 0 prefills, replicas 1 and 2
decode), over real ZMQ sockets standing where the replicas' frontends would: a request
goes to a decode replica (reserve), then, with the blocks its prefix cache holds, to the
prefill replica, whose first token goes to the decode replica (KvReady), whose output
reaches the client. A prefill replica that refuses or fails a request frees the decode
replica's blocks (abort) and the request starts over or fails alone; a client's abort
reaches both; a decode replica that fails stops the prefill it waited for; with no prefill
replica serving, a decode replica serves requests whole."""

from __future__ import annotations

import pytest

from meshserve.comm.messages import (AbortRequest, Delta, ErrorReply, GenerateRequest, KvReady, KvReserved,
                                     PrefillDone, Usage)
from meshserve.engine.serving.commands import AbortCommand
from meshserve.engine.serving.replicas.replica_states import ReplicaDown
from support.fake_replicas import add, running_front_door


@pytest.fixture
def door():
    with running_front_door(3, prefill_replicas=1) as parts:
        yield parts


def reserve(replicas, prompt, cached: int = 0):
    """The decode replica's side of the first hop: returns (decode replica, its request)."""
    sent = replicas[1].receive()
    assert isinstance(sent, GenerateRequest) and sent.prompt_token_ids == prompt
    assert sent.handoff.role == "decode" and sent.handoff.peer == 0
    replicas[1].reply(KvReserved(sent.request_id, cached))
    return sent


def test_a_request_is_reserved_on_decode_prefilled_without_the_cached_blocks_then_decoded(door):
    front, inbox, client, replicas = door
    prompt = list(range(40))
    key = add(inbox, "mine", prompt)
    decode = reserve(replicas, prompt, cached=32)
    prefill = replicas[0].receive()
    assert prefill.request_id == decode.request_id and prefill.prompt_token_ids == prompt
    assert (prefill.handoff.role, prefill.handoff.peer, prefill.handoff.first_block) == ("prefill", 1, 2)
    assert prefill.handoff.transfer == decode.handoff.transfer
    replicas[0].reply(PrefillDone(prefill.request_id, 7))
    ready = replicas[1].receive()
    assert isinstance(ready, KvReady) and (ready.request_id, ready.token_id) == (decode.request_id, 7)
    replicas[1].reply(Delta(decode.request_id, "a", [7]))
    replicas[1].reply(Delta(decode.request_id, "b", [8], "length", usage=Usage(40, 2, 32)))
    got = client.wait(2)
    assert [(k, m.request_id, m.token_ids) for k, m in got] == [(key, "mine", [7]), (key, "mine", [8])]
    assert front.router.load(1) == 0 and front._prefill_load[0] == 0
    assert replicas[0].quiet() and replicas[2].quiet()


def test_a_prefill_refusal_frees_the_reservation_and_starts_over(door):
    front, inbox, client, replicas = door
    prompt = list(range(20))
    add(inbox, "mine", prompt)
    decode = reserve(replicas, prompt)
    prefill = replicas[0].receive()
    replicas[0].reply(ErrorReply(prefill.request_id, "overloaded", "too many waiting"))
    abort = replicas[1].receive()
    assert isinstance(abort, AbortRequest) and abort.request_id == decode.request_id
    again = replicas[2].receive()  # the other decode replica, with a new transfer
    assert again.handoff.role == "decode" and again.handoff.transfer != decode.handoff.transfer


def test_a_failed_prefill_replica_fails_its_requests_alone_and_decode_replicas_serve_new_ones_whole(door):
    front, inbox, client, replicas = door
    prompt = list(range(20))
    first = add(inbox, "first", prompt)
    decode = reserve(replicas, prompt)
    replicas[0].receive()
    replicas[0].reply(PrefillDone(decode.request_id, 5))
    replicas[1].receive()  # KvReady: this one decodes now
    add(inbox, "second", prompt)
    second = replicas[2].receive()
    front.retry = False
    inbox.put(ReplicaDown(0, "killed by SIGKILL"))
    abort = replicas[2].receive()
    assert isinstance(abort, AbortRequest) and abort.request_id == second.request_id
    got = client.wait(1)
    assert got[0][1].code == "unavailable" and "prefill replica 0" in got[0][1].message
    replicas[1].reply(Delta(decode.request_id, "x", [5, 6], "length", usage=Usage(20, 2)))
    got = client.wait(2)
    assert got[1][0] == first and got[1][1].finish_reason == "length"
    add(inbox, "third", prompt)  # no prefill replica serves: a decode replica computes the prompt itself
    third = replicas[1].receive()
    assert isinstance(third, GenerateRequest) and third.handoff is None and third.prompt_token_ids == prompt
    assert front.health()[0] == 200


def test_an_abort_reaches_both_replicas_and_a_failed_decode_replica_stops_its_prefill(door):
    front, inbox, client, replicas = door
    prompt = list(range(20))
    key = add(inbox, "mine", prompt)
    decode = reserve(replicas, prompt)
    replicas[0].receive()
    inbox.put(AbortCommand(key))
    assert isinstance(replicas[1].receive(), AbortRequest)
    assert isinstance(replicas[0].receive(), AbortRequest)
    replicas[1].reply(Delta(decode.request_id, "", [], "abort", usage=Usage(20, 0)))
    assert client.wait(1)[0][1].finish_reason == "abort"
    front.retry = False
    add(inbox, "other", prompt)
    other = replicas[2].receive()
    replicas[2].reply(KvReserved(other.request_id, 0))
    replicas[0].receive()
    inbox.put(ReplicaDown(2, "killed by SIGKILL"))
    stop = replicas[0].receive()
    assert isinstance(stop, AbortRequest) and stop.request_id == other.request_id
    got = client.wait(2)
    assert got[1][1].code == "unavailable" and front._prefill_load[0] == 0


def test_a_request_aborted_while_reserving_still_reaches_the_prefill_replica_which_ends_it(door):
    front, inbox, client, replicas = door
    prompt = list(range(20))
    key = add(inbox, "mine", prompt)
    decode = replicas[1].receive()
    inbox.put(AbortCommand(key))
    assert isinstance(replicas[1].receive(), AbortRequest)
    replicas[1].reply(KvReserved(decode.request_id, 0))  # reserved before the abort arrived: receives are posted
    told = replicas[0].receive()
    assert isinstance(told, GenerateRequest) and told.handoff.transfer == decode.handoff.transfer
    stop = replicas[0].receive()  # ... and only the prefill replica can answer them (zeros, as it ends)
    assert isinstance(stop, AbortRequest) and stop.request_id == decode.request_id


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded"])
def test_cache_aware_routing_picks_the_prefill_replica_holding_the_prefix(policy):
    """Prefill replicas 0 and 1, decode replica 2: a prompt computed on replica 0 leaves its
    blocks there; while replica 0 is busier, a prompt sharing that prefix goes back to it
    under cache_aware, to the less busy replica 1 under least_loaded."""
    with running_front_door(3, prefill_replicas=2) as (front, inbox, client, replicas):
        front.router.policy = policy
        shared = list(range(64))

        def through_prefill(request_id, prompt):
            add(inbox, request_id, prompt)
            sent = replicas[2].receive()
            replicas[2].reply(KvReserved(sent.request_id, 0))
            for r in (0, 1):
                if not replicas[r].quiet():
                    return r, sent
            raise AssertionError("no prefill replica was asked")

        first, sent = through_prefill("a", shared + [1, 2, 3])
        assert first == 0  # least loaded, tie: the first
        replicas[0].receive()
        replicas[0].reply(PrefillDone(sent.request_id, 7))
        assert isinstance(replicas[2].receive(), KvReady)
        busy, _ = through_prefill("busy", list(range(500, 540)))  # both idle: replica 0, which stays busy
        assert busy == 0
        replicas[0].receive()
        again, _ = through_prefill("b", shared + [4, 5, 6])
        assert again == (0 if policy == "cache_aware" else 1)
