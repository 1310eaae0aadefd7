"""Shared-secret frames (comm/auth.py) and the sockets that use them, in one process:
seal/open against tampering and wrong secrets; the control plane and the heartbeats drop
what does not authenticate or decode and keep working (on unix sockets, as on one node,
where the HMAC tag is what tells a rank's frame from another local process's; across
nodes CURVE keeps such peers out first: tests/unit/test_curve.py); the ZMQ frontend
answers an unauthenticated client with "unauthorized" and nothing else, and serves one
with the secret.
"""

from __future__ import annotations

import contextlib

import logging
import os
import queue
import random
import shutil
import tempfile
import threading
import time

import msgspec
import pytest
import zmq

from meshserve.client import AsyncClient, Client, MeshserveError
from meshserve.comm.auth import TAG_BYTES, DropLog, FrameAuth
from meshserve.comm.control import ControlPlaneError, DriverChannel, WorkerChannel
from meshserve.comm.heartbeat import Heartbeat, HeartbeatMonitor
from meshserve.comm.messages import (Delta, ErrorReply, GenerateRequest, RankStats, StepPlan, StepResult,
                                     TokenLogprob, Usage, encoder, server_decoder)
from meshserve.comm.step_results import ExpectedResult
from meshserve.engine.serving.commands import AddCommand, Inbox
from meshserve.engine.serving.zmq_frontend import ZmqFrontend

SECRET = "correct horse battery staple"


# ------------------------------------------------------------------ seal / open


def test_seal_open_round_trip():
    auth = FrameAuth(SECRET, "client")
    for payload in (b"", b"x", os.urandom(1000)):
        sealed = auth.seal(payload)
        assert len(sealed) == len(payload) + TAG_BYTES and sealed.startswith(payload)
        assert auth.open(sealed) == payload
    assert FrameAuth(SECRET.encode(), "client").open(auth.seal(b"abc")) == b"abc"  # bytes or str: same key


def test_tampered_frames_do_not_open():
    auth = FrameAuth(SECRET, "client")
    sealed = auth.seal(b"some request payload")
    for i in (0, 5, len(sealed) - TAG_BYTES - 1, len(sealed) - TAG_BYTES, len(sealed) - 1):
        bad = bytearray(sealed)
        bad[i] ^= 0x01
        assert auth.open(bytes(bad)) is None, f"flipped byte {i}"
    assert auth.open(sealed[:-1]) is None
    assert auth.open(sealed + b"\0") is None
    assert auth.open(sealed[:TAG_BYTES - 1]) is None  # shorter than a tag
    assert auth.open(b"") is None
    assert auth.open(b"some request payload") is None  # never sealed


def test_wrong_secret_or_other_channel_does_not_open():
    sealed = FrameAuth(SECRET, "client").seal(b"payload")
    assert FrameAuth(SECRET + "!", "client").open(sealed) is None
    assert FrameAuth(SECRET, "control").open(sealed) is None  # keys differ per channel
    assert FrameAuth(None, "client").open(sealed) == sealed  # no secret: the frame as it is


def test_no_secret_is_the_identity():
    auth = FrameAuth(None, "control")
    assert not auth.enabled and FrameAuth(SECRET, "control").enabled
    assert auth.seal(b"abc") == b"abc" and auth.open(b"abc") == b"abc"
    with pytest.raises(ValueError, match="empty"):
        FrameAuth("", "control")


def test_drop_log_is_rate_limited(caplog):
    drop = DropLog(logging.getLogger("test.drop"), every=60.0)
    with caplog.at_level(logging.WARNING, logger="test.drop"):
        for i in range(100):
            drop("dropped frame %d", i)
    assert [r.getMessage() for r in caplog.records] == ["dropped frame 0"]
    drop._last -= 61  # a minute later: one line, with the count
    with caplog.at_level(logging.WARNING, logger="test.drop"):
        drop("dropped frame %d", 100)
    assert caplog.records[-1].getMessage() == "dropped frame 100 (and 99 more dropped since the last warning)"


# ------------------------------------------------------------------ control plane


def _garbage(rng: random.Random) -> tuple[list[bytes], list[bytes]]:
    """Frames an unknown peer might send the driver's PULL socket: (undecodable ones,
    well-formed messages)."""
    enc = encoder()
    result = enc.encode(StepResult(7, [1, 2], [3, 4]))
    undecodable = [os.urandom(rng.randint(0, 300)) for _ in range(40)] + [
        b"", result[:5], result[:-1], enc.encode([1, 2, 3]), enc.encode({"type": "result"}), b"\xdd\xff\xff\xff\xff",
        b"\x91" * 5000, enc.encode(StepPlan(1, [], [], [])), enc.encode({"type": "stats", "rank": "x"}),
    ]
    return undecodable, [result, enc.encode(RankStats(1, 9.0, 9.0, 999))]


@pytest.fixture
def ipc_dir():
    """A private directory (mode 0700) for unix sockets, with a path short enough for them."""
    path = tempfile.mkdtemp(prefix="ms-auth-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _connected(ipc_dir, secret_driver, secret_worker, world_size=2):
    driver = DriverChannel(world_size, secret_driver, ipc_dir=ipc_dir)
    worker = WorkerChannel(driver.addresses, 1, secret=secret_worker)
    return driver, worker


@contextlib.contextmanager
def _joined_with_rogue(ipc_dir, secret):
    """A driver and one rank that completed the handshake, and a rogue PUSH socket
    connected to the driver's PULL socket."""
    driver, worker = _connected(ipc_dir, secret, secret)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        t = threading.Thread(target=worker.handshake, args=(10,))
        t.start()
        driver.handshake(10)
        t.join(10)
        rogue.connect(driver.addresses.split()[1])
        yield driver, worker, rogue
    finally:
        rogue.close()
        ctx.term()
        worker.close()
        driver.close()


def test_control_plane_drops_unauthenticated_and_undecodable_frames(caplog, ipc_dir):
    with _joined_with_rogue(ipc_dir, SECRET) as (driver, worker, rogue):
        sealed = FrameAuth(SECRET, "control")
        undecodable, wellformed = _garbage(random.Random(0))
        # unsealed (even well-formed ones), and sealed garbage that does not decode; and a
        # sealed RankStats of a rank that does not exist
        frames = undecodable + wellformed + [sealed.seal(f) for f in undecodable]
        frames.append(sealed.seal(encoder().encode(RankStats(99, 1.0, 1.0, 1))))
        with caplog.at_level(logging.WARNING, logger="meshserve.comm.control"):
            for f in frames:
                rogue.send(f)
            time.sleep(0.3)
            driver.drain()  # drops them all, without raising
            worker.send_stats(RankStats(1, 0.5, 1.0, 3))
            driver.expect(ExpectedResult(1, (0,), (None,), 100))
            worker.send_result(StepResult(1, [0], [42]))
            assert driver.recv_result(1, 10) == StepResult(1, [0], [42])
        assert set(driver.rank_stats) == {1} and driver.rank_stats[1].steps == 3  # rank 99 was never recorded
        assert any("dropped an unauthenticated control-plane frame" in r.getMessage() for r in caplog.records)
        driver.publish(StepPlan(2, [], [], []))
        assert worker.recv(10) == StepPlan(2, [], [], [])


def test_control_plane_without_secret_drops_undecodable_frames(ipc_dir):
    with _joined_with_rogue(ipc_dir, None) as (driver, worker, rogue):
        for f in _garbage(random.Random(1))[0]:  # no secret: a well-formed result must fit a step in flight
            rogue.send(f)
        time.sleep(0.3)
        driver.drain()
        driver.expect(ExpectedResult(5, (0,), (None,), 100))
        worker.send_result(StepResult(5, [0], [1]))
        assert driver.recv_result(5, 10).step_id == 5


LP = TokenLogprob(5, -0.1, [(5, -0.1), (6, -2.5)])
EXPECTED = ExpectedResult(4, (7, 9), (None, 2), 100)
"""Step 4 samples sequences 7 (no logprobs) and 9 (top 2) of a 100-token vocabulary."""
GOOD = StepResult(4, [7, 9], [3, 5], [None, LP])
FORGED = {
    "a step not in flight": StepResult(5, [7, 9], [3, 5], [None, LP]),
    "a missing sequence": StepResult(4, [9], [5], [LP]),
    "an unknown sequence": StepResult(4, [7, 9, 11], [3, 5, 1], [None, LP, None]),
    "a duplicate": StepResult(4, [7, 7], [3, 3], [None, None]),
    "another order": StepResult(4, [9, 7], [5, 3], [LP, None]),
    "fewer tokens": StepResult(4, [7, 9], [3], [None, LP]),
    "more tokens": StepResult(4, [7, 9], [3, 5, 6], [None, LP]),
    "a token past the vocabulary": StepResult(4, [7, 9], [3, 100], [None, LP]),
    "a negative token": StepResult(4, [7, 9], [-1, 5], [None, LP]),
    "no logprobs": StepResult(4, [7, 9], [3, 5]),
    "too few logprobs": StepResult(4, [7, 9], [3, 5], [LP]),
    "logprobs nobody asked for": StepResult(4, [7, 9], [3, 5], [LP, LP]),
    "logprobs of another token": StepResult(4, [7, 9], [3, 6], [None, LP]),
    "too many alternatives": StepResult(4, [7, 9], [3, 5], [None, TokenLogprob(5, -0.1, [(5, -0.1)] * 3)]),
    "an alternative past the vocabulary": StepResult(4, [7, 9], [3, 5],
                                                     [None, TokenLogprob(5, -0.1, [(5, -0.1), (1000, -9.0)])]),
}


def test_expected_result_accepts_only_the_sampling_ranks_answer():
    assert EXPECTED.problem(GOOD) is None
    problems = {what: EXPECTED.problem(result) for what, result in FORGED.items()}
    assert all(problems.values()), [what for what, problem in problems.items() if problem is None]
    assert problems["a missing sequence"] == "sequences [9], but step 4 samples [7, 9]"
    assert problems["a token past the vocabulary"] == "token ids [100] outside the vocabulary of 100"
    no_logprobs = ExpectedResult(2, (), (), 100)
    assert no_logprobs.problem(StepResult(2, [], [])) is None
    assert no_logprobs.problem(StepResult(2, [], [], [])) == "logprobs no sequence asked for"


def test_driver_drops_results_that_do_not_answer_a_step_in_flight(ipc_dir, caplog):
    """Without a secret any local process of this user reaches the PULL socket: a result that
    does not fit the step in flight is dropped with a warning; the rank's own is taken, once."""
    with _joined_with_rogue(ipc_dir, None) as (driver, worker, rogue):
        driver.expect(EXPECTED)
        with caplog.at_level(logging.WARNING, logger="meshserve.comm.control"):
            for result in FORGED.values():
                for _ in range(100):
                    rogue.send(encoder().encode(result))
            time.sleep(0.5)
            driver.drain()  # they are all dropped, without raising
            worker.send_result(GOOD)
            assert driver.recv_result(4, 10) == GOOD
            rogue.send(encoder().encode(GOOD))  # a replay: step 4 is no longer in flight
            time.sleep(0.2)
            driver.drain()
        with pytest.raises(ControlPlaneError, match="step 4: no result is expected"):
            driver.recv_result(4, 1)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings and warnings[0].startswith("dropped a step result for step 5 that the sampling rank did not "
                                               "send: no result for that step is in flight"), warnings
    assert len(warnings) == 1, "the drops are rate-limited"


def test_rank_with_another_secret_never_joins(ipc_dir):
    driver, worker = _connected(ipc_dir, SECRET, "another secret")
    try:
        with pytest.raises(ControlPlaneError, match="nothing from the driver"):
            worker.handshake(1.0)  # every Hello was dropped
        with pytest.raises(ControlPlaneError, match="no Ready from ranks"):
            driver.handshake(0.5)
    finally:
        worker.close()
        driver.close()


# ------------------------------------------------------------------ heartbeats


def test_heartbeats_need_the_secret(ipc_dir):
    """A peer that sends the right rank and session without the secret is not a heartbeat."""
    failures: list[str] = []
    driver = HeartbeatMonitor(0, 2, "session", 0.1, 1.0, failures.append, ipc_dir=ipc_dir, secret=SECRET)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(driver.addresses.split()[1])
    driver.start()
    try:
        forged = msgspec.msgpack.encode(Heartbeat(1, "session"))
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            rogue.send(forged)
            rogue.send(os.urandom(50))
            rogue.send(FrameAuth(SECRET, "heartbeat").seal(b"\xc1garbage"))
            time.sleep(0.05)
        assert len(failures) == 1 and "rank 1 sent no heartbeat" in failures[0]
    finally:
        driver.stop()
        rogue.close()
        ctx.term()

    failures.clear()
    driver = HeartbeatMonitor(0, 2, "s2", 0.1, 1.0, failures.append, ipc_dir=ipc_dir, secret=SECRET)
    rank1 = HeartbeatMonitor(1, 2, "s2", 0.1, 1.0, failures.append, addresses=driver.addresses, secret=SECRET)
    driver.start()
    rank1.start()
    try:
        time.sleep(2.0)
        assert failures == [] and driver.failed is None and rank1.failed is None
    finally:
        rank1.stop()
        driver.stop()


# ------------------------------------------------------------------ the ZMQ frontend


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]


@pytest.fixture
def frontend():
    inbox = Inbox()
    fe = ZmqFrontend("tcp://127.0.0.1:0", inbox, _Tokenizer(), vocab_size=100, max_model_len=64, secret=SECRET)
    fe.start()
    stop = threading.Event()

    def engine():  # answers every request with one sealed Delta
        while not stop.is_set():
            try:
                cmd = inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(cmd, AddCommand):
                fe.send(cmd.key, Delta(cmd.request_id, "ok", [1], "length", usage=Usage(len(cmd.prompt_ids), 1)))

    t = threading.Thread(target=engine, daemon=True)
    t.start()
    yield fe
    stop.set()
    t.join(5)
    fe.close()


def test_frontend_refuses_clients_without_the_secret(frontend):
    for secret in (None, "wrong secret"):
        with Client(frontend.address, timeout=10, secret=secret) as c:
            with pytest.raises(MeshserveError) as e:
                c.generate("hello", max_tokens=1, request_id="r1")
            assert e.value.code == "unauthorized" and e.value.request_id == "r1"
    with Client(frontend.address, timeout=10, secret=SECRET) as c:
        out = c.generate("hello", max_tokens=1)
        assert (out.text, out.token_ids, out.finish_reason) == ("ok", [1], "length")


def test_async_client_with_and_without_the_secret(frontend):
    import asyncio

    async def run(secret):
        async with AsyncClient(frontend.address, timeout=10, secret=secret) as c:
            return await c.generate("hi", max_tokens=1)

    assert asyncio.run(run(SECRET)).text == "ok"
    with pytest.raises(MeshserveError, match="unauthorized"):
        asyncio.run(run(None))


def test_frontend_answers_raw_garbage_with_unauthorized_only(frontend):
    """Random frames, well-formed unsealed requests and multipart messages: one unsealed
    "unauthorized" reply each, nothing decoded, nothing reaching the engine."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(frontend.address)
    decoder = server_decoder()
    rng = random.Random(2)
    request = encoder().encode(GenerateRequest("raw-1", prompt="hi"))
    messages = [[os.urandom(rng.randint(0, 200))] for _ in range(30)] + [[request], [request, b"x"], [b"", b""]]
    try:
        for m in messages:
            sock.send_multipart(m)
        replies = []
        while len(replies) < len(messages) and sock.poll(5000):
            replies.append(decoder.decode(sock.recv()))  # unsealed: decodes without the secret
        assert len(replies) == len(messages)
        assert all(isinstance(r, ErrorReply) and r.code == "unauthorized" for r in replies)
        assert replies[30].request_id == "raw-1"
        # sealed garbage passes the tag and fails decoding: a sealed bad_request
        sealed = FrameAuth(SECRET, "client")
        sock.send(sealed.seal(b"\x92\x01\x02"))
        assert sock.poll(5000)
        reply = decoder.decode(sealed.open(sock.recv()))
        assert reply.code == "bad_request"
    finally:
        sock.close()
        ctx.term()
    with Client(frontend.address, timeout=10, secret=SECRET) as c:
        assert c.generate("still serving", max_tokens=1).text == "ok"
