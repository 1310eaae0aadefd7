"""End to end: bad input and missing credentials against a real `meshserve serve` (a tiny
random Llama, parallel.tensor=2, so the driver has a control plane and heartbeats), with
server.secret and server.api_key given through the launcher's environment.

One server for the module. Fuzzing is bounded by a seeded count and a deadline. Oracles:
every bad client frame or HTTP request gets exactly one error (the ZMQ reply codes, HTTP 4xx
in OpenAI's shape); frames on the control plane's and heartbeats' sockets (unix sockets in a
private directory, on one node) are dropped with a log line; and afterwards a normal request
succeeds, every rank still runs, and the server drains, exits 0 and removes the directory.
Last, a server of its own at pipeline=2 without a secret, against forged step results.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import stat
import threading
import time
from dataclasses import dataclass

import httpx
import msgspec
import pytest
import zmq

from meshserve.client import Client, MeshserveError
from meshserve.comm.auth import FrameAuth
from meshserve.comm.heartbeat import Heartbeat
from meshserve.comm.messages import (ErrorReply, GenerateRequest, RankStats, Ready, SamplingParams, StepPlan,
                                     StepResult, TokenLogprob, client_decoder, control_decoder, encoder,
                                     server_decoder)
from meshserve.engine.serving.zmq_frontend import MAX_REQUEST_BYTES
from meshserve.launcher.cli import main
from support.checkpoints import make_checkpoint
from support.server import EXACT, MeshserveProcess, free_port, http_server

SECRET = "fuzz-secret-0123456789"
API_KEY = "fuzz-api-key"
MAX_MODEL_LEN = 256
VOCAB_SIZE = 49152
TIMEOUT = 60.0
FUZZ_FRAMES = 300
FUZZ_SECONDS = 30.0
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Served:
    proc: MeshserveProcess
    zmq: str
    url: str
    control: list[str]
    """The driver's control-plane and heartbeat endpoints, from its log."""


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_dir) -> Served:
    root = tmp_path_factory.mktemp("fuzz")
    ckpt = make_checkpoint(root / "llama", "llama", tokenizer_from=tokenizer_dir)
    zmq_address = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, MESHSERVE_SECRET=SECRET, MESHSERVE_API_KEY=API_KEY, OMP_NUM_THREADS="1")
    with http_server(root, f"model.path={ckpt}", "parallel.tensor=2", f"model.max_model_len={MAX_MODEL_LEN}",
                     "cache.memory=16MiB", zmq=zmq_address, env=env, ready_timeout=180) as (proc, url):
        yield Served(proc, zmq_address, url, control_addresses(proc))


def control_addresses(proc: MeshserveProcess) -> list[str]:
    """The driver's control-plane and heartbeat sockets (PUB, PULL, PUB, PULL), from its log:
    on one node, unix sockets in one private directory."""
    log = proc.tail(200_000)
    control = re.findall(r"control plane at (\S+) \(PUB\) (\S+) \(PULL\): unix sockets in a directory of mode 0700",
                         log)
    assert len(control) == 1, f"the driver logs its control-plane addresses once:\n{log[-3000:]}"
    heartbeats = re.findall(r"heartbeats at (\S+) \(PUB\) (\S+) \(PULL\)", log)
    addresses = [*control[0], *(heartbeats[0] if heartbeats else ())]
    directory = os.path.dirname(addresses[0].removeprefix("ipc://"))
    assert all(a.startswith(f"ipc://{directory}/") for a in addresses), addresses
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    return addresses


def socket_dir(served) -> str:
    return os.path.dirname(served.control[0].removeprefix("ipc://"))


def _alive(served: Served) -> None:
    assert served.proc.proc.poll() is None, f"the server died:\n{served.proc.tail()}"


def _normal_request(served: Served) -> None:
    """A request that must succeed after whatever the test did."""
    _alive(served)
    with Client(served.zmq, timeout=TIMEOUT, secret=SECRET) as c:
        out = c.generate("The capital of France is", max_tokens=4, temperature=0, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 4


# ------------------------------------------------------------------ ZMQ: who may talk


def test_zmq_client_needs_the_secret(served):
    for secret in (None, "a wrong secret"):
        with Client(served.zmq, timeout=TIMEOUT, secret=secret) as c:
            with pytest.raises(MeshserveError) as e:
                c.generate("Hello", max_tokens=2)
            assert e.value.code == "unauthorized", e.value
    _normal_request(served)


# ------------------------------------------------------------------ ZMQ frontend fuzz


def _fuzz_messages(rng: random.Random) -> list[list[bytes]]:
    """Client messages (frame lists) that must each get one ErrorReply and start nothing."""
    seal = FrameAuth(SECRET, "client").seal
    enc = encoder()
    good = enc.encode(GenerateRequest("good", prompt="hi", params=SamplingParams(max_tokens=2)))
    wrong_types = [
        5, "generate", [1, 2, 3], None, {}, {"type": "generate"}, {"type": "generate", "request_id": 5},
        {"type": "nope", "request_id": "x"}, {"type": "generate", "request_id": "x", "prompt": 7},
        {"type": "generate", "request_id": "x", "prompt_token_ids": [-1]},
        {"type": "generate", "request_id": "x", "prompt_token_ids": [1 << 40]},
        {"type": "generate", "request_id": "x", "prompt": "hi", "params": {"max_tokens": 0}},
        {"type": "generate", "request_id": "x", "prompt": "hi", "params": {"temperature": -1.0}},
        {"type": "generate", "request_id": "x", "prompt": "hi", "params": {"max_tokens": 10 ** 12}},
        {"type": "generate", "request_id": "x", "prompt": "hi", "params": {"stop": ["s"] * 1000}},
        {"type": "generate", "request_id": "x", "prompt": "hi", "extra": 1},
        {"type": "generate", "request_id": "x" * 1000, "prompt": "hi"},
        {"type": "generate", "request_id": "x", "prompt": "hi", "prompt_token_ids": [1]},
        {"type": "generate", "request_id": "x", "prompt_token_ids": [1] * (MAX_MODEL_LEN + 1)},
        {"type": "generate", "request_id": "x", "prompt": "x" * (64 * MAX_MODEL_LEN + 1)},
        {"type": "abort", "request_id": 3},
    ]
    fixed = [enc.encode(w) for w in wrong_types] + [b"\x91" * 10_000, b"\xdd\xff\xff\xff\xff", b"\xc1"]
    messages: list[list[bytes]] = []
    for f in fixed:
        messages += [[f], [seal(f)]]  # unsealed: unauthorized; sealed: bad_request or too_long
    messages += [[good], [good[:-1]], [seal(good[: rng.randrange(len(good))])], [seal(good)[:-1]], [seal(good), b""],
                 [b"", b""], [seal(b"")], [b"x" * (MAX_REQUEST_BYTES + 1)]]
    while len(messages) < FUZZ_FRAMES:
        kind = rng.randrange(4)
        blob = os.urandom(rng.choice((0, 1, 8, 31, 32, 33, 100, 1000, 20_000)))
        if kind == 0:
            messages.append([blob])
        elif kind == 1:
            messages.append([seal(blob)])
        elif kind == 2:  # a valid request with bytes changed, sealed after the damage
            bad = bytearray(good)
            for _ in range(rng.randint(1, 4)):
                bad[rng.randrange(len(bad))] = rng.randrange(256)
            if not _decodes(bytes(bad)):  # (a change that leaves a valid request is no fuzz case)
                messages.append([seal(bytes(bad))])
        else:  # multipart garbage
            messages.append([os.urandom(rng.randint(0, 64)) for _ in range(rng.randint(2, 5))])
    return messages


def _decodes(frame: bytes) -> bool:
    try:
        client_decoder().decode(frame)
        return True
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


def test_fuzz_zmq_frontend(served):
    rng = random.Random(1234)
    messages = _fuzz_messages(rng)
    auth = FrameAuth(SECRET, "client")
    decoder = server_decoder()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(served.zmq)
    codes: dict[str, int] = {}
    deadline = time.monotonic() + FUZZ_SECONDS
    try:
        for m in messages:
            sock.send_multipart(m)
        for _ in messages:
            assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), \
                f"{sum(codes.values())} of {len(messages)} replies within {FUZZ_SECONDS} s: {codes}"
            frame = sock.recv()
            payload = auth.open(frame)
            reply = decoder.decode(frame if payload is None else payload)
            assert isinstance(reply, ErrorReply), reply
            assert payload is not None or reply.code in ("unauthorized", "too_long"), reply  # unsealed: refusals only
            codes[reply.code] = codes.get(reply.code, 0) + 1
        assert not sock.poll(500), "more replies than messages"
    finally:
        sock.close()
        ctx.term()
    assert set(codes) <= {"unauthorized", "bad_request", "too_long"}, codes
    assert codes["unauthorized"] > 50 and codes["bad_request"] > 50 and codes["too_long"] >= 3, codes
    _normal_request(served)


# ------------------------------------------------------------------ control plane fuzz


def test_fuzz_control_plane(served):
    """Unknown peers on the driver's control-plane and heartbeat sockets: raw bytes on TCP,
    and ZMQ frames (random, truncated, well-formed but unsealed, sealed garbage)."""
    assert len(served.control) == 4, "the driver logs its heartbeat addresses too"
    rng = random.Random(99)
    enc = encoder()
    control_seal = FrameAuth(SECRET, "control").seal
    forged = [enc.encode(StepResult(10 ** 6, [0], [1])), enc.encode(StepResult(0, [], [])),
              enc.encode(RankStats(1, 1.0, 1.0, 1)), enc.encode(Ready(1, "session")),
              msgspec.msgpack.encode(Heartbeat(1, "session"))]
    # sealed with the secret, results that answer no step: at tp = 2 the driver samples itself
    sealed_results = [control_seal(enc.encode(StepResult(step, [seq], [token])))
                      for step in range(0, 40, 3) for seq in (0, 1, 10 ** 9) for token in (0, VOCAB_SIZE, -5)]
    ctx = zmq.Context()
    pushes = []
    for address in served.control[1::2]:  # the PULL sockets
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 2000)
        s.connect(address)
        pushes.append(s)
    sub = ctx.socket(zmq.SUB)  # a listener on the plan stream
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(served.control[0])
    sent = 0
    deadline = time.monotonic() + FUZZ_SECONDS
    try:
        for address in served.control:  # raw bytes: not even a ZMTP greeting
            for n in (0, 10, 64, 4096):
                with socket.socket(socket.AF_UNIX) as raw:
                    raw.settimeout(5)
                    raw.connect(address.removeprefix("ipc://"))
                    raw.sendall(os.urandom(n))
        for frame in sealed_results:
            pushes[0].send(frame)
        while sent < FUZZ_FRAMES and time.monotonic() < deadline:
            kind = rng.randrange(4)
            if kind == 0:
                frame = os.urandom(rng.choice((0, 1, 31, 32, 33, 200, 5000)))
            elif kind == 1:
                frame = rng.choice(forged)
            elif kind == 2:
                frame = control_seal(os.urandom(rng.randint(0, 100)))
            else:
                f = rng.choice(forged)
                frame = f[: rng.randrange(len(f))]
            pushes[sent % len(pushes)].send(frame)
            sent += 1
        assert sent == FUZZ_FRAMES
        time.sleep(1.0)
    finally:
        for s in (*pushes, sub):
            s.close()
        ctx.term()
    _normal_request(served)
    _normal_request(served)  # and another step after the fuzz frames were taken in
    log = served.proc.tail(1_000_000)
    assert "dropped an unauthenticated control-plane frame" in log
    assert "dropped an unauthenticated liveness frame" in log
    assert "that the sampling rank did not send: no result for that step is in flight" in log
    assert "Traceback" not in log, log[-4000:]


# ------------------------------------------------------------------ HTTP


def _assert_openai_error(resp: httpx.Response, status: int | tuple[int, ...], what: str) -> dict:
    statuses = (status,) if isinstance(status, int) else status
    assert resp.status_code in statuses, f"{what}: {resp.status_code} {resp.text[:300]}"
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, f"{what}: {body}"
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], what
    return body["error"]


def test_http_needs_the_api_key(served):
    url = served.url
    with httpx.Client(timeout=TIMEOUT) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                        {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/nope"),
                                 ("GET", "/openapi.json"), ("GET", "/metrics")):
                resp = http.request(method, f"{url}{path}", headers=headers, json={"prompt": "hi"})
                err = _assert_openai_error(resp, 401, f"{method} {path} {headers}")
                assert err["code"] == "invalid_api_key" and resp.headers["www-authenticate"] == "Bearer"
        assert http.get(f"{url}/health").status_code == 200
        auth = {"Authorization": f"Bearer {API_KEY}"}
        assert http.get(f"{url}/metrics", headers=auth).status_code == 200  # server.metrics.public=false
        assert http.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"]
        resp = http.post(f"{url}/v1/completions", headers=auth,
                         json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


def test_bench_sends_the_api_key(served, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MESHSERVE_API_KEY", raising=False)
    args = ["bench", "--url", served.url, "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
            "--disable-tqdm", "--no-plots"]
    assert main(args) == 1
    assert "401" in capsys.readouterr().err
    assert main([*args, "--api-key", API_KEY, "--output", str(tmp_path / "bench.json")]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 2 and result["total_output_tokens"] == 4, result
    monkeypatch.setenv("MESHSERVE_API_KEY", API_KEY)  # the launcher's default for --api-key
    assert main(args) == 0


HTTP_CASES = [
    ("completions", b"{not json"), ("completions", b""), ("completions", b"[]"), ("completions", b"null"),
    ("completions", b'"a string"'), ("completions", b"[" * 100_000), ("completions", b"\xff\xfe\x00garbage"),
    ("completions", {"prompt": 5}), ("completions", {"prompt": None}), ("completions", {"prompt": "hi", "n": 10 ** 6}),
    ("completions", {"prompt": "hi", "max_tokens": 10 ** 12}), ("completions", {"prompt": "hi", "max_tokens": 2 ** 70}),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}), ("completions", {"prompt": "hi", "max_tokens": -5}),
    ("completions", {"prompt": "hi", "temperature": -1}), ("completions", {"prompt": "hi", "temperature": 1e308}),
    ("completions", {"prompt": "hi", "top_p": 0}), ("completions", {"prompt": "hi", "seed": -1}),
    ("completions", {"prompt": "hi", "seed": 2 ** 64}), ("completions", {"prompt": "hi", "logprobs": 10 ** 6}),
    ("completions", {"prompt": "hi", "stop": ["s"] * 1000}), ("completions", {"prompt": "hi", "stop": "x" * 10_000}),
    ("completions", {"prompt": "hi", "stop_token_ids": [10 ** 9]}), ("completions", {"prompt": "hi", "repetition_penalty": 0}),
    ("completions", {"prompt": "x" * (2 << 20)}), ("completions", {"prompt": [10 ** 12]}),
    ("completions", {"prompt": [-1]}), ("completions", {"prompt": []}), ("completions", {"prompt": [[1, 2]] * 1000}),
    ("completions", {"prompt": [1] * (MAX_MODEL_LEN + 1)}), ("completions", {"prompt": {"a": 1}}),
    ("completions", {"prompt": "hi", "stream": "maybe"}), ("completions", {"prompt": "hi", "model": "other"}),
    ("completions", {"prompt": "hi", "min_tokens": 100, "max_tokens": 5}),
    ("chat/completions", {"messages": []}), ("chat/completions", {"messages": "hi"}),
    ("chat/completions", {"messages": [{"role": "hacker", "content": "x"}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * (4 << 20)}]}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10 ** 12}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 5}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
]


def test_fuzz_http(served):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    rng = random.Random(7)
    with httpx.Client(base_url=f"{served.url}/v1", timeout=TIMEOUT, headers=auth) as http:
        for path, body in HTTP_CASES:
            content = body if isinstance(body, bytes) else msgspec.json.encode(body)
            resp = http.post(f"/{path}", content=content, headers={"Content-Type": "application/json"})
            _assert_openai_error(resp, (400, 404), f"{path} {content[:80]!r}")
        for _ in range(30):  # random bytes, and valid JSON with random values
            content = rng.choice([os.urandom(rng.randint(0, 200)),
                                  msgspec.json.encode({"prompt": rng.choice(["hi", 3, [1.5], None, True]),
                                                       rng.choice(["max_tokens", "n", "top_k", "best_of"]):
                                                           rng.choice([-1, 0, 10 ** 15, "x", [], 2.5])})])
            resp = http.post("/completions", content=content, headers={"Content-Type": "application/json"})
            if resp.status_code != 200:  # a random body may be a valid request
                _assert_openai_error(resp, (400, 404), f"random {content[:80]!r}")
        resp = http.post("/completions", content=b"{}", headers={"Content-Type": "text/plain"})
        _assert_openai_error(resp, 400, "wrong content type")
        _assert_openai_error(http.get("/completions"), 405, "GET /v1/completions")
        big = b'{"prompt": "' + b"x" * (17 << 20) + b'"}'
        _assert_openai_error(http.post("/completions", content=big), 413, "17 MiB body")

        def chunks():  # no Content-Length: the limit applies as the body arrives
            for _ in range(17):
                yield b"x" * (1 << 20)

        _assert_openai_error(http.post("/completions", content=chunks()), 413, "17 MiB chunked body")
        resp = http.post("/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                               "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 3
    _normal_request(served)


def test_server_drains_and_exits_cleanly(served):
    _normal_request(served)
    assert os.path.isdir(socket_dir(served))
    assert served.proc.stop() == 0, served.proc.tail()
    assert not served.proc.group_alive()
    assert not os.path.exists(socket_dir(served)), "the driver removes its socket directory"


# ------------------------------------------------------------------ forged step results, no secret


def _forgeries(plan: StepPlan) -> list[StepResult]:
    """Results for `plan`'s step (or near it) that no step can have as its answer: each has
    one defect, whatever the step samples (greedy requests, no logprobs)."""
    seqs = [d.seq_id for d in plan.running] + [n.seq_id for n in plan.new]
    step, ones = plan.step_id, [1] * len(seqs)
    return [StepResult(step + 10 ** 9, seqs, ones), StepResult(step, [*seqs, 10 ** 9], [*ones, 1]),
            StepResult(step, [seqs[0], seqs[0]], [1, 1]), StepResult(step, seqs, [*ones, 1]),
            StepResult(step, seqs, [VOCAB_SIZE] * len(seqs)), StepResult(step, seqs, [-1] * len(seqs)),
            StepResult(step, seqs, ones, [TokenLogprob(1, 0.0, [])] * len(seqs))]


def _attack(pub: str, pull: str, stop: threading.Event, sent: list[int]) -> None:
    """A local process of the deployment's user without the secret: it reads the plans on the
    PUB socket and answers each with forged results on the PULL socket, REPEAT times each."""
    ctx = zmq.Context()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    for s in (sub, push):
        s.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    push.connect(pull)
    enc, dec = encoder(), control_decoder()
    try:
        while not stop.is_set():
            if not sub.poll(50):
                continue
            plan = dec.decode(sub.recv())
            if isinstance(plan, StepPlan) and plan.num_seqs:
                frames = [enc.encode(r) for r in _forgeries(plan)]
                for _ in range(REPEAT):
                    for frame in frames:
                        push.send(frame)
                sent[0] += REPEAT * len(frames)
    finally:
        sub.close()
        push.close()
        ctx.term()


REPEAT = 100
PP_PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]


def test_forged_step_results_change_nothing_at_pp2_without_a_secret(tmp_path, tokenizer_dir):
    """The attack of issue 20 (forged StepResults killed the server): no secret, pp = 2 (the
    last stage samples, so the driver takes every step's tokens from its PULL socket), and a
    process of the same user answering every plan it reads with forged results, thousands in
    all, for the steps in flight: the server drops them, answers exactly as it did before the
    attack, drains and exits 0, and removes its socket directory."""
    ckpt = make_checkpoint(tmp_path / "llama", "llama", tokenizer_from=tokenizer_dir)
    zmq_address = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("MESHSERVE_SECRET", "MESHSERVE_API_KEY")}
    proc = MeshserveProcess(
        ["-m", "meshserve.launcher.cli", "serve", "--set", EXACT, "--set", f"model.path={ckpt}",
         "--set", "parallel.pipeline=2",
         "--set", f"server.zmq={zmq_address}", "--set", "server.http=null",
         "--set", f"model.max_model_len={MAX_MODEL_LEN}", "--set", "cache.memory=16MiB"],
        tmp_path, env=dict(env, OMP_NUM_THREADS="1"))
    try:
        proc.wait_ready(180)
        pub, pull = control_addresses(proc)[:2]

        def generate() -> list[list[int]]:
            with Client(zmq_address, timeout=TIMEOUT) as c:
                return [c.generate(p, max_tokens=12, temperature=0, ignore_eos=True).token_ids for p in PP_PROMPTS]

        want = generate()
        stop, sent = threading.Event(), [0]
        attacker = threading.Thread(target=_attack, args=(pub, pull, stop, sent))
        attacker.start()
        try:
            time.sleep(0.5)  # subscribed
            got = generate()
        finally:
            stop.set()
            attacker.join(30)
        assert got == want
        assert sent[0] >= 10_000, sent
        log = proc.tail(1_000_000)
        assert "that the sampling rank did not send" in log and "Traceback" not in log, log[-4000:]
        directory = os.path.dirname(pub.removeprefix("ipc://"))
        assert proc.stop() == 0, proc.tail()
        assert not os.path.exists(directory)
    finally:
        proc.kill()
