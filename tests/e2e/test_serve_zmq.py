"""End to end: a real `meshserve serve` process (built-in SmolLM2-135M-Instruct, one CPU rank)
driven over ZeroMQ by the Python clients and by raw DEALER sockets.

One server serves the whole module (it takes seconds to start on 2 cores). The oracles:
transformers' greedy continuation, the same request run alone, the non-streaming result
for streams, and the ErrorReply codes of the client protocol. The fixture's teardown is a
test too: requests in flight when SIGTERM arrives drain to completion and the server exits 0.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import zmq

from meshserve.client import AsyncClient, Client, MeshserveError
from meshserve.comm.messages import (AbortRequest, Delta, ErrorReply, GenerateRequest, SamplingParams, encoder,
                                     server_decoder)
from support.checkpoints import smollm2_tokenizer
from support.server import EXACT, free_port

MAX_MODEL_LEN = 1024
VOCAB_SIZE = 49152
EOS = 2
READY_TIMEOUT = 120.0
TIMEOUT = 60.0  # seconds a client waits for each message of a reply

# Prompts for the transformers comparison. The chat one is answered in 7 tokens and EOS (2);
# transformers' generate does not stop at EOS for this GGUF, so the comparison cuts there.
TEXT_PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]
CHAT_PROMPT = "What is the capital of France? Reply with one word."
CLI_PROMPTS = ["Once upon a time, in a small village,", "The three primary colors are"]
CONCURRENT_PROMPTS = [
    "Water boils at a temperature of",
    "The quick brown fox",
    "In 1969, the first humans",
    "import numpy as np\n",
    "My favourite fruit is",
    "To make a cup of tea, first",
    "The sun rises in the",
    "Photosynthesis is the process by which",
]


# ------------------------------------------------------------------ processes


def _meshserve_command() -> list[str]:
    """The installed console script (the public entry point), else the module."""
    script = Path(sys.executable).parent / "meshserve"
    if script.is_file():
        return [str(script)]
    found = shutil.which("meshserve")
    return [found] if found else [sys.executable, "-m", "meshserve.launcher.cli"]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as e:
        return f"<cannot read {path}: {e}>"


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    address: str
    stderr_path: Path
    stdout_lines: "queue.Queue[str]" = field(default_factory=queue.Queue)

    def failure(self, what: str) -> str:
        return f"{what}; exit code {self.proc.poll()}; server stderr:\n{_tail(self.stderr_path)}"


@dataclass
class Launched:
    server: ServerProcess
    cli: subprocess.Popen
    cli_stderr: Path


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Starts the server and a `meshserve generate --json` run at once, so that both load the
    model while this process loads the transformers reference (3 loads, 2 cores)."""
    logs = tmp_path_factory.mktemp("serve_zmq")
    address = f"tcp://127.0.0.1:{free_port()}"
    err = logs / "server.stderr"
    with open(err, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshserve.launcher.cli", "serve", "--set", EXACT, "--set", f"server.zmq={address}",
             "--set", f"model.max_model_len={MAX_MODEL_LEN}", "--set", "cache.memory=128MiB"],
            stdout=subprocess.PIPE, stderr=f, text=True, bufsize=1)
    server = ServerProcess(proc, address, err)

    def pump():  # keep reading stdout so the pipe never fills
        for line in proc.stdout:
            server.stdout_lines.put(line)
        server.stdout_lines.put("")  # EOF

    threading.Thread(target=pump, name="server-stdout", daemon=True).start()

    cli_err = logs / "generate.stderr"
    args = [a for p in CLI_PROMPTS for a in ("--prompt", p)]
    with open(cli_err, "wb") as f:
        cli = subprocess.Popen(
            [*_meshserve_command(), "generate", "--json", *args, "--max-tokens", "8", "--temperature", "0",
             "--set", EXACT, "--set", "model.max_model_len=512", "--set", "cache.memory=64MiB"],
            stdout=subprocess.PIPE, stderr=f, text=True)
    try:
        yield Launched(server, cli, cli_err)
    finally:  # normally both are gone by now (the server fixture stops the server)
        for p in (proc, cli):
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.fixture(scope="module")
def server(launched):
    """The ZMQ address of a ready server. Teardown: SIGTERM with 3 requests in flight; they
    must all finish normally and the server must exit 0."""
    srv = launched.server
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            line = srv.stdout_lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            srv.proc.kill()
            pytest.fail(srv.failure(f"no 'ready' line within {READY_TIMEOUT:.0f} s"))
        if line == "":
            srv.proc.wait(10)
            pytest.fail(srv.failure("the server exited before printing 'ready'"))
        if "ready" in line:
            assert f"zmq={srv.address}" in line, line
            break
    yield srv.address
    _sigterm_with_requests_in_flight(srv)


def _sigterm_with_requests_in_flight(srv: ServerProcess) -> None:
    assert srv.proc.poll() is None, srv.failure("the server died during the tests")
    n, max_tokens = 3, 40
    started = [threading.Event() for _ in range(n)]
    deltas: list[list[Delta]] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with Client(srv.address, timeout=TIMEOUT) as c:
                for d in c.generate(f"Request number {i} of the drain test:", stream=True, max_tokens=max_tokens,
                                    temperature=0, ignore_eos=True):
                    deltas[i].append(d)
                    started[i].set()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            started[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for ev in started:  # every request is admitted and decoding when the signal arrives
        assert ev.wait(TIMEOUT), srv.failure("a drain-test request got no first delta")
    assert not errors, errors
    seen = len(deltas[0])
    srv.proc.send_signal(signal.SIGTERM)

    # Three deltas after the signal, the step loop has gone round since it saw the stop, so it
    # no longer accepts: a new request is refused while the old ones drain.
    wait_until = time.monotonic() + TIMEOUT
    while len(deltas[0]) < seen + 3 and time.monotonic() < wait_until and threads[0].is_alive():
        time.sleep(0.005)
    assert len(deltas[0]) >= seen + 3 and deltas[0][-1].finish_reason is None, deltas[0][-1]
    with Client(srv.address, timeout=TIMEOUT) as c, pytest.raises(MeshserveError) as refused:
        c.generate("too late", max_tokens=4, temperature=0)
    assert refused.value.code == "unavailable", refused.value

    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), srv.failure("a drained request never finished")
    assert not errors, errors
    for i, ds in enumerate(deltas):
        last = ds[-1]
        assert last.finish_reason == "length", (i, last)
        assert sum(len(d.token_ids) for d in ds) == max_tokens, i
        assert last.usage is not None and last.usage.completion_tokens == max_tokens, last
    try:
        rc = srv.proc.wait(30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        pytest.fail(srv.failure("the server did not exit within 30 s of SIGTERM"))
    assert rc == 0, srv.failure("the server exited non-zero after SIGTERM")


# ------------------------------------------------------------------ references


@dataclass
class Reference:
    tokenizer: object
    prompts: list[list[int]]
    hf_tokens: list[list[int]]  # transformers' greedy continuation, 16 tokens (or up to EOS)


def _chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def _upto_eos(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else list(tokens)


@pytest.fixture(scope="module")
def reference(launched, smollm2_reference) -> Reference:
    """transformers' greedy output for the test prompts. Depends on `launched` so the
    server loads while this loads."""
    from support.reference import hf_greedy

    tok = smollm2_tokenizer()
    prompts = [tok.encode(t) for t in TEXT_PROMPTS] + [_chat_ids(tok, CHAT_PROMPT)]
    for p in prompts:
        assert 10 <= len(p) <= 60, (len(p), p)
    hf = [hf_greedy(smollm2_reference, p, 16) for p in prompts]
    return Reference(tok, prompts, hf)


class Solo:
    """Greedy requests run with no other traffic, memoized: the oracle for concurrent runs."""

    def __init__(self, address: str):
        self.address = address
        self._done: dict[tuple, object] = {}

    def __call__(self, prompt, max_tokens: int, **params):
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens, tuple(sorted(params.items())))
        if key not in self._done:
            with Client(self.address, timeout=TIMEOUT) as c:
                self._done[key] = c.generate(prompt, max_tokens=max_tokens, temperature=0, **params)
        return self._done[key]


@pytest.fixture(scope="module")
def solo(server) -> Solo:
    return Solo(server)


@pytest.fixture()
def client(server):
    with Client(server, timeout=TIMEOUT) as c:
        yield c


# ------------------------------------------------------------------ raw sockets


class Raw:
    """A bare DEALER socket speaking the wire protocol by hand."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.decoder = server_decoder()
        self.encoder = encoder()

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = TIMEOUT):
        assert self.sock.poll(int(timeout * 1000)), f"no reply within {timeout} s"
        return self.decoder.decode(self.sock.recv())

    def error_for(self, *frames: bytes) -> ErrorReply:
        self.send(*frames)
        msg = self.recv()
        assert isinstance(msg, ErrorReply), msg
        return msg

    def generate(self, req: GenerateRequest) -> list[Delta]:
        """Send a request and read its replies to the end (no other request in flight)."""
        self.send(self.encoder.encode(req))
        out = []
        while True:
            msg = self.recv()
            assert isinstance(msg, Delta), msg
            assert msg.request_id == req.request_id, msg
            out.append(msg)
            if msg.finish_reason is not None:
                return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture()
def raw(server):
    r = Raw(server)
    yield r
    r.close()


def _pack(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


# ------------------------------------------------------------------ tests: correctness


def test_greedy_matches_transformers(reference, server, solo):
    assert EOS in reference.hf_tokens[2][:16], "the chat prompt no longer exercises the EOS stop"
    for prompt, want in zip(reference.prompts, reference.hf_tokens):
        got = solo(prompt, 16)
        assert got.finish_reason in ("stop", "length"), got
        assert _upto_eos(got.token_ids) == _upto_eos(want), (prompt, got.text)
        # The server stops at EOS (finish "stop") or after exactly 16 tokens (finish "length").
        if EOS in want:
            assert got.token_ids[-1] == EOS and got.finish_reason == "stop", got
        else:
            assert len(got.token_ids) == 16 and got.finish_reason == "length", got
        tok = reference.tokenizer
        before = tok.decode(prompt, skip_special_tokens=True)
        full = tok.decode(prompt + got.token_ids, skip_special_tokens=True)
        assert full.startswith(before) and got.text == full[len(before):], (got.text, full)
        assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == len(got.token_ids)


def test_text_prompt_is_tokenized_like_transformers(reference, solo):
    by_text = solo(TEXT_PROMPTS[0], 16)
    by_ids = solo(reference.prompts[0], 16)
    assert by_text.token_ids == by_ids.token_ids and by_text.text == by_ids.text
    assert by_text.usage.prompt_tokens == len(reference.prompts[0])


def test_streaming_equals_non_streaming(reference, client, solo):
    for prompt in reference.prompts[:2]:
        whole = solo(prompt, 16)
        deltas = list(client.generate(prompt, stream=True, max_tokens=16, temperature=0))
        assert "".join(d.text for d in deltas) == whole.text
        assert [t for d in deltas for t in d.token_ids] == whole.token_ids
        assert all(d.request_id == deltas[0].request_id for d in deltas)
        assert all(d.token_ids for d in deltas), "a streamed delta without a token"
        assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1]), deltas
        last = deltas[-1]
        assert last.finish_reason == whole.finish_reason
        assert last.usage is not None
        assert last.usage.prompt_tokens == len(prompt)
        assert last.usage.completion_tokens == len(whole.token_ids)


def _pick_stop_word(text: str) -> tuple[str, int]:
    """A word from the middle of `text` whose first occurrence is not at the start."""
    words = [(m.group(), m.start()) for m in re.finditer(r"[A-Za-z]{3,}", text)
             if m.start() > 0 and text.find(m.group()) == m.start() and m.end() < len(text)]
    assert words, f"no usable stop word in {text!r}"
    return words[len(words) // 2]


def test_stop_string(reference, client, solo):
    prompt = reference.prompts[0]
    base = solo(prompt, 16, ignore_eos=True)
    word, at = _pick_stop_word(base.text)
    got = client.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True, stop=[word, "zz-never-zz"])
    assert word not in got.text
    assert got.text == base.text[:at], (word, got.text, base.text)
    assert got.finish_reason == "stop" and got.stop_reason == word, got
    # Tokens: a prefix of the unstopped run, ending with the token that completed the stop string.
    n = len(got.token_ids)
    assert 0 < n < len(base.token_ids) and got.token_ids == base.token_ids[:n], (got.token_ids, base.token_ids)
    tok = reference.tokenizer
    assert word in tok.decode(base.token_ids[:n]) and word not in tok.decode(base.token_ids[:n - 1])
    assert got.usage.completion_tokens == n


def test_stop_string_across_tokens_is_held_back_when_streaming(reference, client, solo):
    prompt = reference.prompts[1]
    base = solo(prompt, 16, ignore_eos=True)
    pieces = [d.text for d in client.generate(prompt, stream=True, max_tokens=16, temperature=0, ignore_eos=True)]
    assert "".join(pieces) == base.text
    # A 4-character stop string made of the last 2 characters of one token and the first 2 of the next.
    ends = [sum(len(p) for p in pieces[:i + 1]) for i in range(len(pieces))]
    choice = None
    for i in range(len(pieces) // 2, len(pieces) - 1):
        b = ends[i]
        stop = base.text[b - 2:b + 2]
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2 and base.text.find(stop) == b - 2:
            choice = (i, b, stop)
            break
    assert choice, f"no token boundary to put a stop string on in {pieces!r}"
    i, b, stop = choice
    deltas = list(client.generate(prompt, stream=True, max_tokens=16, temperature=0, ignore_eos=True, stop=stop))
    text = "".join(d.text for d in deltas)
    assert text == base.text[:b - 2], (stop, text)
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert [t for d in deltas for t in d.token_ids] == base.token_ids[:i + 2]


def test_seed_reproducible(reference, server, client):
    prompt = reference.prompts[0]
    kw = dict(max_tokens=16, temperature=1.0, seed=123)
    a = client.generate(prompt, **kw)
    b = client.generate(prompt, **kw)
    assert a.token_ids == b.token_ids and a.text == b.text and len(a.token_ids) > 0
    others = [client.generate(prompt, max_tokens=16, temperature=1.0, seed=s).token_ids for s in (124, 125)]
    assert any(o != a.token_ids for o in others), "the seed has no effect"

    async def with_traffic():
        async with AsyncClient(server, timeout=TIMEOUT) as ac:
            noise = [ac.generate(p, max_tokens=12, temperature=t) for p, t in
                     zip(CONCURRENT_PROMPTS[:4], (0.0, 1.0, 0.7, 1.0))]
            results = await asyncio.gather(ac.generate(prompt, **kw), *noise)
            return results[0]

    c = asyncio.run(with_traffic())
    assert c.token_ids == a.token_ids, "a seeded request sampled differently next to other requests"


def test_abort(reference, server, client):
    rid = f"abort-{uuid.uuid4().hex[:8]}"
    stream = client.generate(reference.prompts[0], stream=True, request_id=rid, max_tokens=500, ignore_eos=True,
                             temperature=0)
    first = [next(stream), next(stream)]
    assert all(d.finish_reason is None for d in first)
    client.abort(rid)
    rest = list(stream)
    last = rest[-1]
    assert last.finish_reason == "abort", last
    assert all(d.finish_reason is None for d in rest[:-1])
    n = sum(len(d.token_ids) for d in first + rest)
    assert 2 <= n < 100, n
    assert last.usage is not None and last.usage.completion_tokens == n
    # The id is free again on this connection.
    again = client.generate(reference.prompts[0], request_id=rid, max_tokens=2, temperature=0)
    assert again.finish_reason == "length" and len(again.token_ids) == 2


def test_concurrent_clients_match_solo_runs(server, solo):
    want = {p: solo(p, 8) for p in CONCURRENT_PROMPTS}
    got: dict[str, object] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(CONCURRENT_PROMPTS))

    def run(p: str) -> None:
        try:
            with Client(server, timeout=TIMEOUT) as c:
                barrier.wait(TIMEOUT)
                got[p] = c.generate(p, max_tokens=8, temperature=0)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in CONCURRENT_PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT)
    assert not errors, errors
    for p in CONCURRENT_PROMPTS:
        assert p in got, f"{p!r} never finished"
        assert got[p].token_ids == want[p].token_ids and got[p].text == want[p].text, p
        assert got[p].finish_reason == want[p].finish_reason

    async def run_async():
        async with AsyncClient(server, timeout=TIMEOUT) as ac:
            return await asyncio.gather(*(ac.generate(p, max_tokens=8, temperature=0) for p in CONCURRENT_PROMPTS))

    for p, r in zip(CONCURRENT_PROMPTS, asyncio.run(run_async())):
        assert r.token_ids == want[p].token_ids and r.text == want[p].text, p
        assert r.usage.completion_tokens == len(want[p].token_ids)


# ------------------------------------------------------------------ tests: bad input


def _good_raw_request(raw: Raw, reference: Reference, solo: Solo) -> None:
    """The same socket is still served, with the right tokens."""
    want = solo(reference.prompts[0], 16).token_ids[:2]
    rid = f"good-{uuid.uuid4().hex[:8]}"
    deltas = raw.generate(GenerateRequest(rid, prompt_token_ids=reference.prompts[0],
                                          params=SamplingParams(max_tokens=2, temperature=0.0), stream=False))
    assert len(deltas) == 1 and deltas[0].finish_reason == "length", deltas
    assert deltas[0].token_ids == want


BAD_FRAMES = {
    "random bytes": ((b"\xc1\xff\x00 not msgpack \x93",), None, ["malformed"]),
    "empty frame": ((b"",), None, ["malformed"]),
    "a list": ((_pack([1, 2, 3]),), None, ["malformed", "array"]),
    "a string": ((_pack("generate"),), None, ["malformed", "str"]),
    "unknown type tag": ((_pack({"type": "shutdown", "request_id": "t1"}),), "t1", ["malformed", "shutdown"]),
    "unknown field": ((_pack({"type": "generate", "request_id": "u1", "prompt": "hi", "bogus": 1}),), "u1",
                      ["bogus"]),
    "prompt of the wrong type": ((_pack({"type": "generate", "request_id": "w1", "prompt": 5}),), "w1", ["prompt"]),
    "params of the wrong type": ((_pack({"type": "generate", "request_id": "w2", "prompt": "hi",
                                         "params": {"max_tokens": "ten"}}),), "w2", ["max_tokens"]),
    "request_id of the wrong type": ((_pack({"type": "generate", "request_id": 7, "prompt": "hi"}),), None,
                                     ["request_id"]),
    "two frames": ((_pack({"type": "generate", "request_id": "f1", "prompt": "hi"}), b"extra"), None,
                   ["one message frame", "2"]),
    "neither prompt": ((_pack({"type": "generate", "request_id": "n1"}),), "n1", ["prompt", "prompt_token_ids"]),
    "both prompts": ((_pack({"type": "generate", "request_id": "b1", "prompt": "hi", "prompt_token_ids": [1]}),),
                     "b1", ["prompt", "prompt_token_ids"]),
    "negative token id": ((_pack({"type": "generate", "request_id": "g1", "prompt_token_ids": [5, -1]}),), "g1",
                          ["prompt_token_ids"]),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_bad_frame_gets_an_error_and_the_server_goes_on(case, raw, reference, solo):
    frames, rid, words = BAD_FRAMES[case]
    err = raw.error_for(*frames)
    assert err.code == "bad_request", err
    assert err.request_id == rid, err
    for w in words:
        assert w in err.message, (w, err.message)
    _good_raw_request(raw, reference, solo)


def test_oversized_frame_gets_an_error_and_the_server_goes_on(server, reference, solo):
    """A frame over the 16 MiB request limit gets a too_long reply; the server goes on serving."""
    big = Raw(server)
    try:
        big.send(_pack({"type": "generate", "request_id": "big", "prompt": "x" * (17 << 20)}))
        assert big.sock.poll(30_000), "no reply to an oversized frame"
        err = server_decoder().decode(big.sock.recv())
        assert isinstance(err, ErrorReply) and err.code == "too_long" and "bytes" in err.message
    finally:
        big.close()
    fresh = Raw(server)
    try:
        _good_raw_request(fresh, reference, solo)
    finally:
        fresh.close()


def test_abort_of_unknown_request_is_ignored(raw, reference, solo):
    raw.send(raw.encoder.encode(AbortRequest("no-such-request")))
    assert not raw.sock.poll(300), "an abort of an unknown request got a reply"
    _good_raw_request(raw, reference, solo)


LONG = [5] * (MAX_MODEL_LEN + 76)

BAD_REQUESTS = {
    # name: (prompt, params, code, words the message must contain)
    "empty text prompt": ("", {}, "bad_request", ["empty"]),
    "empty token prompt": ([], {}, "bad_request", ["empty"]),
    "token id outside the vocab": ([1, 2, VOCAB_SIZE + 10], {}, "bad_request", [str(VOCAB_SIZE + 10), str(VOCAB_SIZE)]),
    "stop token id outside the vocab": ("hi", {"stop_token_ids": [VOCAB_SIZE]}, "bad_request", [str(VOCAB_SIZE)]),
    "negative temperature": ("hi", {"temperature": -1.0}, "bad_request", ["temperature"]),
    "top_p 0": ("hi", {"top_p": 0.0}, "bad_request", ["top_p"]),
    "max_tokens 0": ("hi", {"max_tokens": 0}, "bad_request", ["max_tokens"]),
    "min_tokens > max_tokens": ("hi", {"min_tokens": 9, "max_tokens": 4}, "bad_request", ["9", "4", "min_tokens"]),
    "prompt longer than max_model_len": (LONG, {}, "too_long", [str(MAX_MODEL_LEN), str(len(LONG))]),
    "prompt + max_tokens over max_model_len": ([5] * 1000, {"max_tokens": 100}, "too_long",
                                               [str(MAX_MODEL_LEN), "1100"]),
    "huge text prompt": ("word " * (16 * MAX_MODEL_LEN), {}, "too_long", [str(MAX_MODEL_LEN)]),
}


CLIENT_CHECKED = {"negative temperature": "temperature", "top_p 0": "top_p", "max_tokens 0": "max_tokens"}
"""Cases the client refuses before sending (naming the keyword); sent by hand, the server
refuses them too."""


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_the_server_goes_on(case, client, raw, reference, solo):
    prompt, params, code, words = BAD_REQUESTS[case]
    rid = f"bad-{uuid.uuid4().hex[:8]}"
    params = {"max_tokens": 4, "temperature": 0, **params}
    if case in CLIENT_CHECKED:
        with pytest.raises(ValueError, match=rf"Client.generate\(\): {CLIENT_CHECKED[case]}: "):
            client.generate(prompt, request_id=rid, **params)
        # msgspec does not validate on construction: the server's own check is what refuses it
        raw.send(raw.encoder.encode(GenerateRequest(rid, prompt=prompt, params=SamplingParams(**params))))
        err = raw.recv()
        assert isinstance(err, ErrorReply) and err.code == code, err
        message = err.message
    else:
        with pytest.raises(MeshserveError) as e:
            client.generate(prompt, request_id=rid, **params)
        assert e.value.code == code, e.value
        assert e.value.request_id == rid, e.value
        message = e.value.message
    for w in words:
        assert w in message, (w, message)
    good = client.generate(reference.prompts[0], max_tokens=2, temperature=0)
    assert good.token_ids == solo(reference.prompts[0], 16).token_ids[:2]


def test_duplicate_request_id_on_the_wire(raw, reference):
    """The server refuses a request_id already running on the same connection; the running
    request is unaffected."""
    rid = f"dup-{uuid.uuid4().hex[:8]}"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    req = GenerateRequest(rid, prompt_token_ids=reference.prompts[0], params=params, stream=True)
    raw.send(raw.encoder.encode(req))
    first = raw.recv()
    assert isinstance(first, Delta) and first.finish_reason is None, first
    raw.send(raw.encoder.encode(req))
    msgs = [first]
    while not (isinstance(msgs[-1], Delta) and msgs[-1].finish_reason is not None):
        msgs.append(raw.recv())
    errors = [m for m in msgs if isinstance(m, ErrorReply)]
    assert len(errors) == 1 and errors[0].code == "duplicate_id", msgs
    assert rid in errors[0].message
    deltas = [m for m in msgs if isinstance(m, Delta)]
    assert sum(len(d.token_ids) for d in deltas) == 24 and deltas[-1].finish_reason == "length"


def test_duplicate_request_id_through_client(server, reference):
    """Client: reusing the id of a running request fails with duplicate_id, and the running
    request's stream still ends normally."""
    rid = f"dup-{uuid.uuid4().hex[:8]}"
    with Client(server, timeout=TIMEOUT) as c:
        stream = c.generate(reference.prompts[0], stream=True, request_id=rid, max_tokens=24, ignore_eos=True,
                            temperature=0)
        deltas = [next(stream)]
        with pytest.raises(MeshserveError) as e:
            c.generate(reference.prompts[0], request_id=rid, max_tokens=4, temperature=0)
        assert e.value.code == "duplicate_id", e.value
        deltas += list(stream)
    assert deltas[-1].finish_reason == "length", deltas[-1]
    assert sum(len(d.token_ids) for d in deltas) == 24


def test_duplicate_request_id_through_async_client(server, reference):
    """AsyncClient: as above; the running request must neither hang nor be aborted."""
    rid = f"dup-{uuid.uuid4().hex[:8]}"

    async def run():
        async with AsyncClient(server, timeout=10.0) as ac:
            stream = await ac.generate(reference.prompts[0], stream=True, request_id=rid, max_tokens=24,
                                       ignore_eos=True, temperature=0)
            deltas = [await stream.__anext__()]
            with pytest.raises(MeshserveError) as e:
                await ac.generate(reference.prompts[0], request_id=rid, max_tokens=4, temperature=0)
            assert e.value.code == "duplicate_id", e.value
            async for d in stream:
                deltas.append(d)
            return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].finish_reason == "length", deltas[-1]
    assert sum(len(d.token_ids) for d in deltas) == 24


def test_bad_frame_burst_does_not_disturb_a_running_request(server, reference, solo):
    prompt, n = reference.prompts[1], 40
    want = solo(prompt, n, ignore_eos=True)
    arrivals: list[tuple[float, Delta]] = []
    first = threading.Event()
    failed: list[BaseException] = []

    def read_stream() -> None:
        try:
            with Client(server, timeout=TIMEOUT) as c:
                for d in c.generate(prompt, stream=True, max_tokens=n, temperature=0, ignore_eos=True):
                    arrivals.append((time.monotonic(), d))
                    first.set()
        except BaseException as e:  # noqa: BLE001
            failed.append(e)
            first.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    raw = Raw(server)
    try:
        assert first.wait(TIMEOUT)
        burst = [(b"\x00garbage" * 3,), (_pack([1, 2]),), (_pack({"type": "generate", "request_id": 3}),),
                 (b"a", b"b", b"c"), (_pack({"type": "generate", "request_id": "x", "prompt": 1.5}),)] * 40
        for frames in burst:
            raw.send(*frames)
        replies = [raw.recv() for _ in burst]
        errors_answered = time.monotonic()
    finally:
        raw.close()
        reader.join(2 * TIMEOUT)
    assert not failed, failed
    assert all(isinstance(r, ErrorReply) and r.code == "bad_request" for r in replies)
    deltas = [d for _, d in arrivals]
    assert deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert errors_answered < arrivals[-1][0], "the error replies waited for the running request to finish"
    times = [t for t, _ in arrivals]
    gap = max(b - a for a, b in zip(times, times[1:]))
    assert gap < 10.0, f"a {gap:.1f} s stall between deltas"


def test_abort_from_another_connection_is_ignored(server, reference, client):
    """Requests belong to the connection that sent them: another client cannot abort one."""
    rid = f"mine-{uuid.uuid4().hex[:8]}"
    stream = client.generate(reference.prompts[0], stream=True, request_id=rid, max_tokens=40, ignore_eos=True,
                             temperature=0)
    deltas = [next(stream)]
    with Client(server, timeout=TIMEOUT) as other:
        other.abort(rid)
        # A reply on the same connection: the abort (sent first) has been handled by now.
        assert len(other.generate(reference.prompts[0], max_tokens=1, temperature=0).token_ids) == 1
    deltas += list(stream)
    assert deltas[-1].finish_reason == "length", deltas[-1]
    assert sum(len(d.token_ids) for d in deltas) == 40


# ------------------------------------------------------------------ tests: offline CLI


def test_generate_cli_json_matches_server(launched, solo):
    try:
        out, _ = launched.cli.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        launched.cli.kill()
        pytest.fail(f"meshserve generate did not finish; stderr:\n{_tail(launched.cli_stderr)}")
    assert launched.cli.returncode == 0, _tail(launched.cli_stderr)
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == len(CLI_PROMPTS), out
    for prompt, line in zip(CLI_PROMPTS, lines):
        obj = json.loads(line)
        assert isinstance(obj["text"], str) and isinstance(obj["token_ids"], list), obj
        want = solo(prompt, 8)
        assert obj["token_ids"] == want.token_ids, (prompt, obj, want)
        assert obj["text"] == want.text
        assert len(obj["token_ids"]) == 8 or obj["token_ids"][-1] == EOS
