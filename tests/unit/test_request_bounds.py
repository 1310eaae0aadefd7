"""Untrusted requests are bounded before they are parsed, and nothing a client sends can
reach the ranks unencodable. Oracles: the shapes the body parser returns equal what
json.loads reads; refused bodies name the parameter; an unexpected exception leaves as a 500
in OpenAI's shape with a request id and without its text; the engine refuses a request whose
plan entry cannot be encoded while it keeps serving the others."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter

from meshserve.comm.messages import SamplingParams
from meshserve.engine.serving.http_app import CountingApp, install_error_handlers
from meshserve.engine.serving.openai_protocol import MAX_N, ChatCompletionRequest, CompletionRequest, OpenAIError
from meshserve.engine.serving.request_body import MAX_FIELD_BYTES, parse_body
from meshserve.engine.admission import PROBE_CHARS_PER_TOKEN, RequestError, encode_prompt
from support.engines import make_engine

MAX_MODEL_LEN = 256
VOCAB_SIZE = 1000


@pytest.mark.parametrize("prompt", ["hello", ["a", "b"], [1, 2, 3], [[1], [2, 3]], "\U0001f600 ok"])
def test_prompts_decode_to_what_json_reads(prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 3, "temperature": 0.5}).encode()
    req = parse_body(body, CompletionRequest, MAX_MODEL_LEN)
    assert req.prompt == json.loads(body)["prompt"] and req.max_tokens == 3 and req.temperature == 0.5


def _refused(body: bytes, model=CompletionRequest) -> OpenAIError:
    """The 400 of a body refused as it is parsed or, for a bound of its sampling fields, as its
    SamplingParams is built (the wire type holds those bounds)."""
    with pytest.raises(OpenAIError) as e:
        req = parse_body(body, model, MAX_MODEL_LEN)
        if model is CompletionRequest:
            req.sampling_params(req.max_new_tokens(), req.engine_logprobs, VOCAB_SIZE)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": [' + b",".join([b"[0]"] * (MAX_N + 1)) + b"]}", "prompt"),
    (b'{"prompt": [' + b",".join([b"0"] * (MAX_MODEL_LEN + 1)) + b"]}", "prompt"),
    (b'{"prompt": [' + b",".join([b'"x"'] * (MAX_N + 1)) + b"]}", "prompt"),
    (b'{"prompt": [18446744073709551616]}', "prompt"),
    (b'{"prompt": [true]}', "prompt"),
    (b'{"prompt": [1.0]}', "prompt"),
    (b'{"prompt": []}', "prompt"),
    (b'{"prompt": {"a": 1}}', "prompt"),
    (b'{"max_tokens": 1}', "prompt"),
    (b'{"prompt": "x", "stop": ' + json.dumps(["s"] * MAX_FIELD_BYTES).encode() + b"}", "stop"),
    (b'{"prompt": "x", "top_k": 18446744073709551616}', "top_k"),
    (b'{"prompt": "x", "skip_special_tokens": "no"}', "skip_special_tokens"),
    (b'{"prompt": "x", "n": 2.0}', "n"),
])
def test_refused_bodies_name_the_parameter(body, param):
    err = _refused(body)
    if param is not None:
        assert err.param == param, err.message


@pytest.mark.parametrize("body", [b'{"prompt": "\\ud800"}', b'{"prompt": "a\\udfffb"}', b'{"prompt": "\xed\xa0\x80"}',
                                  b"[1]", b"{", b"", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                                  b"{" * 50_000, b'{"prompt": "x"} trailing', b'{"prompt": NaN}'])
def test_malformed_json_is_a_400(body):
    message = _refused(body).message
    assert re.search(r"not valid JSON|nested too deeply|must be a JSON object", message), message


def test_surrogate_escapes_are_explained():
    assert "surrogate" in _refused(b'{"prompt": "\\ud800"}').message


def test_too_many_messages_are_counted_not_parsed():
    messages = [{"role": "user", "content": ""}] * (MAX_MODEL_LEN + 1)
    err = _refused(json.dumps({"messages": messages}).encode(), ChatCompletionRequest)
    assert err.param == "messages" and err.code == "context_length_exceeded"
    ok = parse_body(json.dumps({"messages": messages[:3]}).encode(), ChatCompletionRequest, MAX_MODEL_LEN)
    assert len(ok.messages) == 3


def test_long_prompts_are_refused_by_their_first_part(tokenizer_dir):
    from transformers import AutoTokenizer

    class Backend:  # the real tokenizer, counting the characters it is given
        def __init__(self):
            self.tok, self.chars = AutoTokenizer.from_pretrained(tokenizer_dir), 0

        def encode(self, text):
            self.chars += len(text)
            return self.tok.encode(text)

    backend = Backend()
    text = "a b " * 4000  # 16,000 characters, 8,000 tokens: far over 256
    with pytest.raises(RequestError) as e:
        encode_prompt(backend, text, MAX_MODEL_LEN)
    assert e.value.code == "too_long" and backend.chars == PROBE_CHARS_PER_TOKEN * MAX_MODEL_LEN < len(text) / 4
    assert encode_prompt(backend, "one two", MAX_MODEL_LEN) == backend.tok.encode("one two")
    with pytest.raises(RequestError):
        encode_prompt(backend, "x" * (64 * MAX_MODEL_LEN + 1), MAX_MODEL_LEN)


def test_an_unexpected_exception_is_a_500_without_its_text(caplog):
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise KeyError("internal detail 0")

    counter = Counter("t_responses", "t", ["path", "status"], registry=CollectorRegistry())
    wrapped = CountingApp(app, counter, None, ("/health",), 5.0)
    transport = httpx.ASGITransport(app=wrapped, raise_app_exceptions=False)

    async def get():
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/boom")

    with caplog.at_level(logging.ERROR):
        resp = asyncio.run(get())
    assert resp.status_code == 500
    err = resp.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert "internal detail" not in resp.text and "KeyError" not in resp.text
    request_id = err["message"].split("request id ")[1].split(";")[0]
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_request_the_ranks_cannot_be_sent_fails_alone(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    # NOTE: msgspec structs do not validate on construction: this is what the bounds keep out
    unbounded = SamplingParams(max_tokens=2, top_k=1 << 70)
    with pytest.raises(RequestError) as e:
        engine.add_request("bad", "bad", [1, 2, 3], unbounded)
    assert e.value.code == "bad_request" and not engine.requests
    engine.add_request("good", "good", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    finished = []
    while engine.has_work():
        finished += [d for _, d in engine.step() if d.finish_reason]
    assert [d.finish_reason for d in finished] == ["length"] and len(finished[0].token_ids) >= 1


def test_the_tokenize_pool_runs_the_shortest_waiting_job_first():
    from meshserve.engine.serving.tokenize_pool import TokenizePool

    pool = TokenizePool(1)
    started, gate, order = threading.Event(), threading.Event(), []

    def hold():
        started.set()
        gate.wait()

    first = pool.submit(10 ** 6, hold)  # holds the only thread while the others queue
    assert started.wait(30)  # else the thread, still free, could take a later job first
    jobs = [pool.submit(size, order.append, size) for size in (500, 3, 40, 3)]
    gate.set()
    for job in [first, *jobs]:
        job.result(timeout=30)
    assert order == [3, 3, 40, 500]
    pool.close()
    with pytest.raises(RuntimeError):
        pool.submit(1, order.append, 1)


@pytest.mark.parametrize("public", [False, True])
def test_metrics_need_the_api_key_unless_public(public):
    app = FastAPI()

    @app.get("/metrics")
    async def metrics():
        return {"ok": True}

    counter = Counter("m_responses", "m", ["path", "status"], registry=CollectorRegistry())
    open_paths = ("/health", "/metrics") if public else ("/health",)
    transport = httpx.ASGITransport(app=CountingApp(app, counter, "key", open_paths, 5.0))

    async def get(headers):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.get("/metrics", headers=headers)).status_code

    assert asyncio.run(get({})) == (200 if public else 401)
    assert asyncio.run(get({"Authorization": "Bearer key"})) == 200
