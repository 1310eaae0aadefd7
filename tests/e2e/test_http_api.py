"""End to end: the OpenAI-compatible HTTP API of a real `meshserve serve` process (built-in
SmolLM2, one CPU rank), driven by the real `openai` package, raw httpx, and `meshserve bench`.

One server serves the module. Oracles: the same server's ZMQ frontend (same engine, another
wire format) for greedy text and token counts; the non-streamed result for streams; the
tokenizer for prompt lengths; OpenAI's error shape and status codes; Prometheus counters
before and after known traffic. The last test drains the server with SIGTERM: /health turns
503, new requests get 503, the request in flight finishes, and the process exits 0.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshserve.client import Client
from support.checkpoints import smollm2_tokenizer
from support.server import MeshserveProcess, free_port, http_server, openai_client

MODEL = "smollm2-135m-instruct"
"""The name the server gives model.path=builtin:smollm2-135m-instruct (its default)."""
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
MAX_WAITING = 8
TIMEOUT = 180.0  # seconds for one request: the machine is slow and shared
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
CHAT_QUESTION = "What is the capital of France? Reply with one word."
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Served:
    proc: MeshserveProcess
    url: str
    zmq: str


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    zmq = f"tcp://127.0.0.1:{free_port()}"
    with http_server(tmp_path_factory.mktemp("http_api"), f"model.max_model_len={MAX_MODEL_LEN}", "cache.memory=64MiB",
                     f"scheduler.max_num_seqs={MAX_NUM_SEQS}", f"scheduler.max_waiting={MAX_WAITING}", zmq=zmq,
                     args=("--drain-timeout", "600")) as (proc, url):
        yield Served(proc, url, zmq)


@pytest.fixture(scope="module")
def url(served) -> str:
    assert served.proc.proc.poll() is None, f"the server died:\n{served.proc.tail()}"
    return served.url


@pytest.fixture(scope="module")
def oai(url) -> openai.OpenAI:
    with openai_client(url, TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def zmq_client(served):
    with Client(served.zmq, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client, as {'name{label="v"}': value}."""
    resp = httpx.get(f"{url}/metrics", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def idle(url: str) -> dict[str, float]:
    """Metrics once no request is running or waiting (aborted ones included)."""
    return wait_for(lambda: (m := metrics(url)) and m["meshserve_num_requests_running"] == 0
                    and m["meshserve_num_requests_waiting"] == 0 and m, "the engine to go idle")


# ------------------------------------------------------------------ completions and chat


def test_models_and_health(url, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    resp = httpx.get(f"{url}/health")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def test_completion_matches_the_zmq_frontend(oai, zmq_client, tok):
    want = zmq_client.generate(PROMPT, max_tokens=12, temperature=0)
    got = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.object == "text_completion" and got.model == MODEL and got.id.startswith("cmpl-")
    [choice] = got.choices
    assert choice.index == 0 and choice.text == want.text and choice.finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(tok.encode(PROMPT)) == want.usage.prompt_tokens
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    # a token-id prompt is the same prompt
    by_ids = oai.completions.create(model=MODEL, prompt=tok.encode(PROMPT), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == want.text


def test_completion_stream_equals_whole(oai):
    whole = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                   extra_body={"ignore_eos": True})
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    *tokens, last = chunks
    assert "".join(c.choices[0].text for c in tokens) == whole.choices[0].text
    assert len(tokens) == 16, "one chunk per token"
    assert all(c.usage is None for c in tokens) and all(c.choices[0].finish_reason is None for c in tokens[:-1])
    assert tokens[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == 16
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1
    # without include_usage, no chunk carries usage
    plain = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    assert plain and all(c.usage is None and c.choices for c in plain)


def test_unknown_fields_are_ignored_and_named_in_a_header(url, oai):
    """Other servers' extensions that change nothing (and vLLM's no-op values of the ones that
    would) are ignored, as vLLM ignores them; the response names what was ignored."""
    want = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "cache_prompt": True,
            "service_tier": "auto", "typical_p": 1.0, "metadata": {"run": "x"}}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == want
    assert resp.headers["x-meshserve-ignored-fields"] == "cache_prompt, service_tier, typical_p, metadata"
    chat = {"model": MODEL, "max_tokens": 2, "temperature": 0, "service_tier": "auto",
            "messages": [{"role": "user", "content": "hi", "refusal": None}], "stream": True,
            "stream_options": {"include_usage": True, "future_option": 1}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat, timeout=60) as r:
        assert r.status_code == 200 and b"[DONE]" in r.read()
        assert r.headers["x-meshserve-ignored-fields"] == ("service_tier, stream_options.future_option, "
                                                         "messages[].refusal")
    plain = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=60)
    assert "x-meshserve-ignored-fields" not in plain.headers


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(oai):
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True},
                                         extra_body={"ignore_eos": True}))
    *tokens, last = chunks
    assert [c.usage.completion_tokens for c in tokens] == [1, 2, 3, 4, 5, 6]
    assert all(c.usage.prompt_tokens == last.usage.prompt_tokens > 0 for c in tokens)
    assert last.choices == [] and last.usage.completion_tokens == 6


def test_chat_whole_and_streamed(oai, zmq_client, tok):
    ids = chat_ids(tok, CHAT_QUESTION)
    want = zmq_client.generate(ids, max_tokens=24, temperature=0)
    messages = [{"role": "user", "content": CHAT_QUESTION}]
    got = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == want.text and "Paris" in msg.content
    assert got.choices[0].finish_reason == "stop" == want.finish_reason  # the model ends with EOS
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.token_ids)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens
    # content parts and a system message go through the template too
    parts = oai.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": CHAT_QUESTION}]}])
    assert parts.choices[0].message.content == msg.content
    # default max_tokens: the rest of the context (the answer is not cut at 16)
    default = oai.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert default.choices[0].message.content == msg.content


def test_stop_strings_whole_and_streamed(oai):
    base = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    words = [m for m in re.finditer(r"[A-Za-z]{3,}", base) if m.start() > 0 and base.find(m.group()) == m.start()]
    assert words, base
    word = words[len(words) // 2]
    for stream in (False, True):
        resp = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=stream,
                                      stop=[word.group(), "zz-never"], extra_body={"ignore_eos": True})
        if stream:
            chunks = list(resp)
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = resp.choices[0].text, resp.choices[0].finish_reason
        assert text == base[:word.start()], (stream, word.group(), text, base)
        assert reason == "stop"


def test_seed_reproducibility(oai):
    def sample(seed):
        return oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.5,
                                      seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1235), sample(1236)}) > 1, "different seeds gave one text"


def test_n_samples(oai, tok):
    resp = oai.completions.create(model=MODEL, prompt="My favourite fruit is", max_tokens=8, n=3, temperature=1.5,
                                  seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.text for c in resp.choices}) > 1, "n samples with one seed must differ (seed + index)"
    assert resp.usage.completion_tokens == 24 and resp.usage.prompt_tokens == len(tok.encode("My favourite fruit is"))
    again = oai.completions.create(model=MODEL, prompt="My favourite fruit is", max_tokens=8, n=3, temperature=1.5,
                                   seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    # streamed: each index gets its own chunks and its own end; two prompts x n=2 = 4 choices
    chunks = list(oai.completions.create(model=MODEL, prompt=["One", "Two"], max_tokens=4, n=2, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}))
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert ends == {0: "length", 1: "length", 2: "length", 3: "length"}
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)}
    assert texts[0] == texts[1] and texts[2] == texts[3], "greedy samples of one prompt agree"


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or
               line.startswith(name + "{"))


def test_chat_n_samples_count_the_prompt_once_and_share_its_blocks(oai, url):
    """n > 1 on chat: n choices, each its own sample (seed + index), usage with the prompt
    once and every choice's tokens; the later choices find the prompt's blocks cached."""
    messages = [{"role": "user", "content": "Name a fruit, and say why you like it " + "very " * 40}]
    hits_before = _metric(url, "meshserve_prefix_cache_hits_total")
    resp = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=3, temperature=1.5, seed=3,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2] and all(c.finish_reason == "length" for c in resp.choices)
    assert len({c.message.content for c in resp.choices}) > 1, "n samples with one seed must differ (seed + index)"
    full_blocks = (resp.usage.prompt_tokens - 1) // 16
    assert _metric(url, "meshserve_prefix_cache_hits_total") - hits_before >= 2 * full_blocks * 16, \
        "choices 1 and 2 reuse the prompt's blocks that choice 0 computes"
    one = oai.chat.completions.create(model=MODEL, messages=messages + [{"role": "assistant", "content": "x"}],
                                      max_tokens=1)
    assert resp.usage.completion_tokens == 18 and resp.usage.total_tokens == resp.usage.prompt_tokens + 18
    assert 0 < resp.usage.prompt_tokens < one.usage.prompt_tokens
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert ends == {0: "length", 1: "length"}
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(2)}
    assert texts[0] == texts[1] and texts[0], "greedy samples of one prompt agree"


def test_logprobs(oai):
    resp = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 4
        assert top[token] == value and value == pytest.approx(max(top.values())), "greedy picks the top token"
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_QUESTION}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())
    assert oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].logprobs is None


# ------------------------------------------------------------------ errors


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_token": 3}, 400, "max_token", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temprature": 0}, 400, "temprature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_p": 1.5}, 400, "min_p",
     "invalid_value"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hello " * 5000}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [49152]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools", "invalid_value"),
]


def _check_error(resp: httpx.Response, status: int, param, code) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), body
    assert err["param"] == param and err["code"] == code, body
    return err


@pytest.mark.parametrize("path,body,status,param,code", BAD_REQUESTS,
                         ids=[f"{i}-{b.get('model') or next(iter(b))}" for i, (_, b, *_) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(url, path, body, status, param, code):
    for stream in (False, True):  # a streamed request gets the same status, before any event
        err = _check_error(httpx.post(f"{url}{path}", json=body | ({"stream": True} if stream else {}), timeout=60),
                           status, param, code)
        assert err["type"] == "invalid_request_error"
        if "stream_options" in body:
            break  # with stream=true the same body is valid


def test_malformed_bodies_and_paths(url):
    _check_error(httpx.post(f"{url}/v1/completions", content=b"{bad json", timeout=30,
                            headers={"content-type": "application/json"}), 400, None, "invalid_value")
    _check_error(httpx.get(f"{url}/v1/nothing-here", timeout=30), 404, None, "not_found")
    _check_error(httpx.get(f"{url}/v1/completions", timeout=30), 405, None, "method_not_allowed")
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    _check_error(httpx.post(f"{url}/v1/completions", content=big, timeout=60,
                            headers={"content-type": "application/json"}), 413, None, "request_too_large")


def test_openai_package_raises_typed_errors(oai):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=1, presence_penalty=2.5)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["code"] == "model_not_found"


def test_overload_is_429_and_the_server_recovers(url, oai):
    # 32 samples cannot fit: at most max_num_seqs run and max_waiting wait, the rest are refused,
    # and the HTTP request fails as a whole (its admitted samples are aborted).
    before = idle(url)
    with pytest.raises(openai.RateLimitError) as refused:
        oai.completions.create(model=MODEL, prompt="Count to a hundred:", max_tokens=64, n=32,
                               extra_body={"ignore_eos": True})
    assert refused.value.status_code == 429 and refused.value.body["code"] == "overloaded"
    after = idle(url)
    aborted = 'meshserve_request_success_total{finished_reason="abort"}'
    assert after.get(aborted, 0) - before.get(aborted, 0) >= MAX_NUM_SEQS
    assert after['meshserve_http_responses_total{path="/v1/completions",status="429"}'] >= 1
    assert oai.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2


# ------------------------------------------------------------------ disconnects, metrics


def test_client_disconnect_aborts_the_request(url):
    aborted = 'meshserve_request_success_total{finished_reason="abort"}'
    before = idle(url)
    body = {"prompt": "Count slowly:", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=TIMEOUT) as resp:
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leave mid-stream: closing the connection must abort the engine request
    streamed = idle(url)
    assert streamed.get(aborted, 0) == before.get(aborted, 0) + 1
    assert streamed["meshserve_generation_tokens_total"] - before["meshserve_generation_tokens_total"] < MAX_MODEL_LEN - 16
    # not streamed: the client gives up waiting (read timeout) and closes the connection
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(3.0, connect=30.0))
    whole = idle(url)
    assert whole.get(aborted, 0) == before.get(aborted, 0) + 2
    assert whole["meshserve_e2e_request_latency_seconds_count"] == before["meshserve_e2e_request_latency_seconds_count"]


EXPECTED_FAMILIES = [
    "meshserve_time_to_first_token_seconds", "meshserve_time_per_output_token_seconds",
    "meshserve_inter_token_latency_seconds", "meshserve_e2e_request_latency_seconds",
    "meshserve_request_queue_time_seconds", "meshserve_num_requests_running", "meshserve_num_requests_waiting",
    "meshserve_kv_cache_usage_ratio", "meshserve_num_preemptions", "meshserve_prompt_tokens",
    "meshserve_generation_tokens", "meshserve_request_success", "meshserve_model_flops_utilization",
    "meshserve_memory_bandwidth_utilization", "meshserve_peak_flops", "meshserve_peak_memory_bandwidth_bytes",
    "meshserve_http_responses", "meshserve_prefix_cache_queries", "meshserve_prefix_cache_hits",
    "meshserve_prefix_cache_hit_rate",
]


def test_metrics_move_with_traffic(url, oai):
    text = httpx.get(f"{url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(EXPECTED_FAMILIES) <= set(families), sorted(set(EXPECTED_FAMILIES) - set(families))
    assert families["meshserve_time_to_first_token_seconds"].type == "histogram"
    assert families["meshserve_generation_tokens"].type == "counter"
    before = idle(url)
    resp = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = idle(url)

    def moved(name):
        return after[name] - before.get(name, 0)

    assert moved("meshserve_prompt_tokens_total") == resp.usage.prompt_tokens
    assert moved("meshserve_generation_tokens_total") == 10
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "time_per_output_token_seconds"):
        assert moved(f"meshserve_{hist}_count") == 1, hist
    assert moved("meshserve_inter_token_latency_seconds_count") == 9
    assert moved('meshserve_request_success_total{finished_reason="length"}') == 1
    assert moved('meshserve_http_responses_total{path="/v1/completions",status="200"}') == 1
    assert moved("meshserve_engine_steps_total") >= 10 and moved("meshserve_model_flops_total") > 0
    # E2E >= TTFT, and both are real durations
    assert moved("meshserve_e2e_request_latency_seconds_sum") >= moved("meshserve_time_to_first_token_seconds_sum") > 0
    assert after["meshserve_peak_flops"] > 1e8 and after["meshserve_peak_memory_bandwidth_bytes"] > 1e8
    assert 0 < after["meshserve_model_flops_utilization"] < 2 and after["meshserve_memory_bandwidth_utilization"] > 0
    assert after["meshserve_kv_cache_usage_ratio"] == 0
    # every rank's occupancy and memory (one rank here)
    assert 0 < after['meshserve_rank_busy_ratio{rank="0"}'] <= 1
    assert after['meshserve_rank_busy_seconds{rank="0"}'] > 0
    assert after['meshserve_rank_resident_memory_bytes{rank="0"}'] > 100e6


# ------------------------------------------------------------------ prefix caching


def test_prefix_cache_in_usage_metrics_and_reset(url, oai, zmq_client, tok):
    """A prompt that extends an earlier one reuses its full blocks (16 tokens): OpenAI's
    usage.prompt_tokens_details.cached_tokens says how many, streamed or not, and so does the
    ZMQ client's usage; another cache_salt shares nothing; the counters move by the prompt
    tokens and the hits; POST /reset_prefix_cache forgets the cache."""
    reset = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200 and reset.json()["status"] == "ok"
    before = idle(url)
    first = tok.encode(PROMPT + " Rome. " + PROMPT)
    shared = len(first) // 16 * 16
    assert shared >= 32

    def complete(prompt, **extra):
        return oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)

    r1 = complete(first)
    r2 = complete(first + [11, 12, 13])
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == shared
    stream = oai.completions.create(model=MODEL, prompt=first + [14, 15], max_tokens=4, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    final = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert final.prompt_tokens_details.cached_tokens == shared
    salted = complete(first + [11, 12, 13], cache_salt="another tenant")
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].text == r2.choices[0].text
    z = zmq_client.generate(first + [16], max_tokens=4, temperature=0)
    assert z.usage.cached_tokens == shared
    z_salted = zmq_client.generate(first + [16], max_tokens=4, temperature=0, cache_salt="another tenant")
    assert z_salted.usage.cached_tokens == shared  # the salted HTTP request's blocks, same salt
    assert z_salted.token_ids == z.token_ids
    after = idle(url)
    prompts = [len(first), len(first) + 3, len(first) + 2, len(first) + 3, len(first) + 1, len(first) + 1]
    assert after["meshserve_prefix_cache_queries_total"] - before["meshserve_prefix_cache_queries_total"] == sum(prompts)
    assert after["meshserve_prefix_cache_hits_total"] - before["meshserve_prefix_cache_hits_total"] == 4 * shared
    assert after["meshserve_prefix_cache_hit_rate"] == pytest.approx(
        after["meshserve_prefix_cache_hits_total"] / after["meshserve_prefix_cache_queries_total"])
    reset = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200 and reset.json()["dropped_blocks"] >= 2 * shared // 16
    assert complete(first + [11, 12, 13]).usage.prompt_tokens_details.cached_tokens == 0


# ------------------------------------------------------------------ bench


def test_bench_counts_match_what_was_sent(url, tmp_path):
    before = idle(url)
    out = tmp_path / "bench.json"
    n, input_len, output_len = 6, 24, 5

    def bench(*extra, num_prompts=n, slo="ttft=600000,tpot=600000"):
        cmd = [sys.executable, "-m", "meshserve.launcher.cli", "bench", "--url", url, "--num-prompts", str(num_prompts),
               "--max-concurrency", "3", "--input-len", str(input_len), "--output-len", str(output_len),
               "--slo", slo, "--output", str(out), "--disable-tqdm", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    done = bench()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Successful requests:" in done.stdout and "Median TTFT (ms):" in done.stdout
    res = json.loads(out.read_text())
    assert res["completed"] == n and res["failed"] == 0 and res["num_prompts"] == n
    assert res["max_concurrency"] == 3 and res["model_id"] == MODEL
    assert res["total_output_tokens"] == n * output_len and res["output_lens"] == [output_len] * n
    assert all(abs(x - input_len) <= input_len // 4 for x in res["input_lens"]), res["input_lens"]
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])  # the SLOs are loose
    assert res["output_throughput"] == pytest.approx(n * output_len / res["duration"])
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert res[key] > 0, key
    assert res["p99_ttft_ms"] >= res["median_ttft_ms"] and res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    assert (tmp_path / "bench_latency_cdf.png").stat().st_size > 1000
    # The server saw exactly that: the bench's requests, plus 2 one-token calibration requests
    # and a 4-token warm-up request.
    after = idle(url)
    assert after["meshserve_generation_tokens_total"] - before["meshserve_generation_tokens_total"] == \
        n * output_len + 2 + 4
    assert after["meshserve_prompt_tokens_total"] - before["meshserve_prompt_tokens_total"] >= \
        res["total_input_tokens"]
    ok = 'meshserve_http_responses_total{path="/v1/completions",status="200"}'
    assert after[ok] - before[ok] == n + 3
    # an impossible SLO: nothing is good; a wrong model: the test request fails, exit 1
    strict = bench("--no-plots", num_prompts=2, slo="ttft=0.001")
    assert strict.returncode == 0, strict.stderr[-3000:]
    assert json.loads(out.read_text())["request_goodput"] == 0
    wrong = bench("--model", "nope", num_prompts=2)
    assert wrong.returncode == 1 and "404" in wrong.stderr


# ------------------------------------------------------------------ drain (last: stops the server)


def test_a_priority_needs_the_priority_policy(oai):
    with pytest.raises(openai.BadRequestError, match="start it with scheduler.policy=priority"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 1})
    assert oai.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 0}).choices


def test_sigterm_drains_and_health_turns_503(served, url):
    proc = served.proc
    body = {"prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events: list[dict] = []
    failure: list[BaseException] = []

    def stream():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
        except BaseException as e:  # noqa: BLE001 - reported below
            failure.append(e)

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    wait_for(lambda: len(events) >= 2 or failure, "the first chunks")
    proc.proc.send_signal(signal.SIGTERM)
    health = wait_for(lambda: (r := httpx.get(f"{url}/health", timeout=30)).status_code == 503 and r,
                      "/health to answer 503", timeout=30)
    assert health.json() == {"status": "draining"}
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=30)
    _check_error(refused, 503, None, "unavailable")
    t.join(TIMEOUT)
    assert not failure and not t.is_alive(), failure
    text_chunks = [e for e in events if e["choices"]]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length", "the in-flight request drained"
    assert events[-1]["usage"]["completion_tokens"] == 40
    assert proc.proc.wait(60) == 0, proc.tail()
