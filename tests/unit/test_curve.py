"""CURVE with keys derived from the shared secret (comm/curve.py), on real sockets in one
process: the derived pairs talk (PUB/SUB, PUSH/PULL); a peer without keys, with another
secret's keys, or with the server's public key but its own client key, receives nothing and
delivers nothing; the control plane and heartbeats over TCP with a secret run on it."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from meshserve.comm.control import DriverChannel, WorkerChannel
from meshserve.comm.curve import CurveAuthenticator, client_keys, make_curve_client, make_curve_server, server_keys
from meshserve.comm.heartbeat import HeartbeatMonitor
from meshserve.comm.messages import RankStats, StepPlan, encoder

SECRET = "a long random shared secret 0123456789"
QUIET_MS = 700
"""How long a peer that must receive nothing listens (a CURVE handshake on loopback takes ~1 ms)."""


def test_keys_are_derived_per_purpose_and_side():
    pub, sec = server_keys(SECRET, "control")
    assert (pub, sec) == server_keys(SECRET.encode(), "control")  # deterministic, str or bytes
    assert len(pub) == len(sec) == 40 and zmq.curve_public(sec) == pub
    keys = {server_keys(SECRET, "control")[0], client_keys(SECRET, "control")[0], server_keys(SECRET, "heartbeat")[0],
            client_keys(SECRET, "heartbeat")[0], server_keys(SECRET + "!", "control")[0]}
    assert len(keys) == 5
    with pytest.raises(ValueError, match="empty"):
        server_keys("", "control")


def _random_client(sock: zmq.Socket) -> None:
    """Knows the server's public key (e.g. leaked) but not the client key the secret gives."""
    make_curve_client(sock, SECRET, "control")
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()


def _other_secret(sock: zmq.Socket) -> None:
    make_curve_client(sock, "another secret", "control")


def _other_purpose(sock: zmq.Socket) -> None:
    make_curve_client(sock, SECRET, "heartbeat")


def _no_keys(sock: zmq.Socket) -> None:
    pass


OUTSIDERS = {"no keys": _no_keys, "another secret": _other_secret, "own client key": _random_client,
             "another purpose's keys": _other_purpose}


def test_derived_keys_pair_and_outsiders_get_nothing():
    ctx, peers = zmq.Context(), zmq.Context()
    auth = CurveAuthenticator(ctx, SECRET)
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    socks = [pub, pull]
    try:
        for s in (pub, pull):
            s.setsockopt(zmq.LINGER, 0)
            make_curve_server(s, SECRET, "control", auth)
            s.bind("tcp://127.0.0.1:0")

        def peer(kind: int, setup, address: str) -> zmq.Socket:
            s = peers.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            if kind == zmq.SUB:
                s.setsockopt(zmq.SUBSCRIBE, b"")
            setup(s)
            s.connect(address)
            socks.append(s)
            return s

        pub_address, pull_address = pub.last_endpoint.decode(), pull.last_endpoint.decode()
        good_sub = peer(zmq.SUB, lambda s: make_curve_client(s, SECRET, "control"), pub_address)
        bad_subs = {name: peer(zmq.SUB, setup, pub_address) for name, setup in OUTSIDERS.items()}
        bad_pushes = {name: peer(zmq.PUSH, setup, pull_address) for name, setup in OUTSIDERS.items()}
        for name, s in bad_pushes.items():
            s.send(name.encode(), zmq.NOBLOCK)  # queued until a handshake completes, which it never does
        good_push = peer(zmq.PUSH, lambda s: make_curve_client(s, SECRET, "control"), pull_address)
        good_push.send(b"from a rank")

        deadline = time.monotonic() + 5
        while not good_sub.poll(20):  # PUB drops until subscribed: publish until the good SUB hears
            assert time.monotonic() < deadline, "the SUB with the derived keys heard nothing"
            pub.send(b"plan")
        for _ in range(20):
            pub.send(b"plan")
        assert good_sub.recv() == b"plan"
        assert pull.poll(5000) and pull.recv() == b"from a rank"
        time.sleep(QUIET_MS / 1000)
        heard = {name: s.poll(0) for name, s in bad_subs.items()}
        assert not any(heard.values()), heard
        assert not pull.poll(QUIET_MS), f"an outsider's PUSH delivered {pull.recv()!r}"
    finally:
        for s in socks:
            s.close()
        auth.close()
        ctx.term()
        peers.term()


def test_authenticator_closes_with_its_context():
    ctx = zmq.Context()
    with CurveAuthenticator(ctx, SECRET) as auth:
        s = ctx.socket(zmq.PULL)
        make_curve_server(s, SECRET, "control", auth)
        s.bind("tcp://127.0.0.1:0")
        s.close()
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(5), "ctx.term() blocked: the authenticator left a socket open"


def _spy(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A SUB socket without keys on one of the driver's PUB sockets."""
    spy = ctx.socket(zmq.SUB)
    spy.setsockopt(zmq.SUBSCRIBE, b"")
    spy.setsockopt(zmq.LINGER, 0)
    spy.connect(address)
    return spy


def test_a_spy_hears_the_plain_tcp_control_plane():
    """The reference for the next test: without a secret (cluster.insecure_control_plane)
    anyone who reaches the PUB port reads what the driver publishes."""
    driver = DriverChannel(2, None, host="127.0.0.1")
    ctx = zmq.Context()
    spy = _spy(ctx, driver.addresses.split()[0])
    try:
        deadline = time.monotonic() + 5
        while not spy.poll(20) and time.monotonic() < deadline:
            driver.publish(StepPlan(1, [], [], []))
        assert encoder().encode(StepPlan(1, [], [], [])) == spy.recv()
    finally:
        spy.close()
        ctx.term()
        driver.close()


def test_control_plane_and_heartbeats_over_tcp_with_a_secret_are_curve(caplog):
    """The driver's channels on a host with a secret: a rank with the secret joins, gets the
    plans and keeps the heartbeats going; a SUB without keys hears nothing on either PUB, and
    a PUSH without keys never reaches the driver (not even to be dropped by the HMAC check)."""
    failures: list[str] = []
    with caplog.at_level(logging.INFO, logger="meshserve.comm"):
        driver = DriverChannel(2, SECRET, host="127.0.0.1")
        beats = HeartbeatMonitor(0, 2, driver.session, 0.1, 1.0, failures.append, host="127.0.0.1", secret=SECRET)
    worker = WorkerChannel(driver.addresses, 1, secret=SECRET)
    rank1_beats = HeartbeatMonitor(1, 2, driver.session, 0.1, 1.0, failures.append, addresses=beats.addresses,
                                   secret=SECRET)
    ctx = zmq.Context()
    spies = [_spy(ctx, driver.addresses.split()[0]), _spy(ctx, beats.addresses.split()[0])]
    rogue = ctx.socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(driver.addresses.split()[1])
    try:
        t = threading.Thread(target=worker.handshake, args=(10,))
        t.start()
        driver.handshake(10)
        t.join(10)
        beats.start()
        rank1_beats.start()
        try:
            rogue.send(encoder().encode(RankStats(1, 1.0, 1.0, 77)), zmq.NOBLOCK)
        except zmq.Again:  # its handshake was refused already: it has no pipe to queue the frame in
            pass
        with caplog.at_level(logging.WARNING, logger="meshserve.comm.control"):
            for step in range(10):
                driver.publish(StepPlan(step, [], [], []))
                assert worker.recv(10) == StepPlan(step, [], [], [])
            time.sleep(1.5)
            driver.drain()
        assert driver.rank_stats == {}
        assert "dropped" not in caplog.text, "the rogue's frame reached the driver"
        assert [s.poll(0) for s in spies] == [0, 0], "a spy without keys heard the driver"
        assert failures == [] and beats.failed is None and rank1_beats.failed is None
    finally:
        for s in (*spies, rogue):
            s.close()
        ctx.term()
        rank1_beats.stop()
        beats.stop()
        worker.close()
        driver.close()
    assert "(PULL): CURVE-encrypted, keys from server.secret, frames authenticated" in caplog.text
    assert "heartbeats at tcp://127.0.0.1:" in caplog.text and caplog.text.count("CURVE-encrypted") == 2
