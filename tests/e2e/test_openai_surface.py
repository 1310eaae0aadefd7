"""End to end: the rest of the OpenAI/vLLM HTTP surface of a real `meshserve serve` (built-in
SmolLM2, one CPU rank, an API key and a CORS allow-list), driven by the real `openai` package
and raw httpx: /tokenize, /detokenize, /tokenizer_info, /version; CORS; OpenAI's exact stream
shapes; the sampling parameters; best_of; echo; chat's template switches; return_token_ids;
truncate_prompt_tokens; continuous usage stats.

One server serves the module. Oracles: the Hugging Face tokenizer (token ids, chat template
renderings), the same server's plain greedy completions (what a switch must or must not
change), and OpenAI's error shape naming the parameter.
"""

from __future__ import annotations

import asyncio
import json
import re
from importlib.metadata import version

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, Counter

from meshserve.configs.schema import Config
from meshserve.engine.serving.http_app import CountingApp, with_cors
from support.checkpoints import smollm2_tokenizer
from support.server import http_server, openai_client

MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512
VOCAB_SIZE = 49152
API_KEY = "surface-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ALLOWED_ORIGIN = "http://app.example"
TIMEOUT = 180.0
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
QUESTION = "What is the capital of France? Reply with one word."
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    with http_server(tmp_path_factory.mktemp("openai_surface"), f"model.max_model_len={MAX_MODEL_LEN}",
                     "cache.memory=64MiB", "scheduler.max_num_seqs=8", f"server.api_key={API_KEY}",
                     f'server.cors_allowed_origins=["{ALLOWED_ORIGIN}"]') as (proc, url):
        yield url
        assert proc.proc.poll() is None, f"the server died:\n{proc.tail()}"


@pytest.fixture(scope="module")
def oai(url) -> openai.OpenAI:
    with openai_client(url, TIMEOUT, API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def http(url) -> httpx.Client:
    with httpx.Client(base_url=url, headers=AUTH, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def chat_ids(tok, messages, **flags) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, **({"add_generation_prompt": True} | flags))
    return tok.encode(text, add_special_tokens=False)


def check_error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["param"] == param and body["error"]["message"], body
    return body["error"]


def sse(resp: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent event stream, up to [DONE] (which must end it)."""
    lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def stream(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body | {"stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        return sse(resp)


def greedy(oai, prompt, max_tokens=8, **extra):
    return oai.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True} | extra)


# ------------------------------------------------------------------ tokenizer endpoints


def test_tokenize_and_detokenize(http, tok):
    text = "Hello world, tokenize me."
    got = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == MAX_MODEL_LEN and got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False) and plain["token_strs"] is None
    assert http.post("/detokenize", json={"model": MODEL, "tokens": got["tokens"]}).json() == {"prompt": text}
    # messages go through the chat template, with vLLM's switches
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The capital is"}]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    for flags in ({}, {"add_generation_prompt": False}, continued, {"chat_template_kwargs": {"unused_variable": 1}}):
        resp = http.post("/tokenize", json={"messages": messages} | flags)
        assert resp.status_code == 200, resp.text
        hf = {k: v for k, v in flags.items() if k != "chat_template_kwargs"}
        assert resp.json()["tokens"] == chat_ids(tok, messages, **hf), flags
    special = tok.convert_tokens_to_ids(["<|im_start|>"])
    assert http.post("/detokenize", json={"tokens": special}).json() == {"prompt": "<|im_start|>"}


def test_tokenizer_info_and_version(http, tok):
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and info["chat_template"] == tok.chat_template
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert "name_or_path" not in info and "site-packages" not in json.dumps(info), "no server paths"
    assert http.get("/version").json() == {"version": version("meshserve")}


TOKENIZER_ERRORS = [
    ("/detokenize", {"tokens": [VOCAB_SIZE]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs"),
    ("/tokenize", {"prompt": "x" * (64 * MAX_MODEL_LEN + 1)}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
]


@pytest.mark.parametrize("path,body,param", TOKENIZER_ERRORS, ids=[f"{p}-{i}" for i, (p, *_) in
                                                                     enumerate(TOKENIZER_ERRORS)])
def test_tokenizer_endpoints_refuse_bad_input(http, path, body, param):
    check_error(http.post(path, json=body), 400, param)


def test_tokenizer_endpoints_need_the_key_and_the_model(url, http):
    check_error(http.post("/tokenize", json={"model": "gpt-4o", "prompt": "x"}), 404, "model")
    check_error(httpx.post(f"{url}/tokenize", json={"prompt": "x"}, timeout=30), 401, None)
    assert http.post("/tokenize", json={"prompt": "still serving"}).status_code == 200


# ------------------------------------------------------------------ CORS


def test_cors_preflight_needs_no_key_and_answers_carry_cors_headers(url):
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(f"{url}/v1/chat/completions", headers=preflight, timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = httpx.options(f"{url}/v1/chat/completions", headers=preflight | {"Origin": "http://evil.example"},
                          timeout=30)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # the request itself still needs the key; its answers (a 401 too) carry the CORS headers
    denied = httpx.get(f"{url}/v1/models", headers={"Origin": ALLOWED_ORIGIN}, timeout=30)
    check_error(denied, 401, None)
    assert denied.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    allowed = httpx.get(f"{url}/v1/models", headers=AUTH | {"Origin": ALLOWED_ORIGIN}, timeout=30)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    # an OPTIONS that is no preflight gets no free pass
    assert httpx.options(f"{url}/v1/models", timeout=30).status_code == 401


def test_cors_default_allows_any_origin():
    assert Config().server.cors_allowed_origins == ["*"]

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    counter = Counter("cors_responses", "c", ["path", "status"], registry=CollectorRegistry())
    app = with_cors(CountingApp(inner, counter, "key", ("/health",), 5.0), Config().server.cors_allowed_origins)

    async def calls():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            pre = await client.options("/v1/models", headers={"Origin": "https://any.example",
                                                              "Access-Control-Request-Method": "GET"})
            get = await client.get("/v1/models", headers={"Origin": "https://any.example",
                                                          "Authorization": "Bearer key"})
            return pre, get

    pre, get = asyncio.run(calls())
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert get.status_code == 200 and get.headers["access-control-allow-origin"] == "*"


# ------------------------------------------------------------------ stream shapes


def test_chat_stream_opens_each_choice_with_the_role_alone(http, oai):
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6, "temperature": 0,
            "n": 2, "stream_options": {"include_usage": True}}
    events = stream(http, "/v1/chat/completions", body)
    assert all("system_fingerprint" in e for e in events), "in every chunk, the usage chunk too"
    whole = oai.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=6, temperature=0)
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""} and mine[0]["finish_reason"] is None
        assert all("role" not in c["delta"] for c in mine[1:]) and mine[-1]["finish_reason"] is not None
        text = "".join(c["delta"]["content"] for c in mine)
        assert text == whole.choices[0].message.content and text
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    # the role chunks come first, before any content
    assert [e["choices"][0]["delta"].get("role") for e in events[:2]] == ["assistant", "assistant"]


def test_system_fingerprint_in_every_response(http):
    whole = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2}).json()
    chunks = stream(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    for body in (whole, chat, *chunks):
        assert "system_fingerprint" in body and body["system_fingerprint"] is None, body


def test_continuous_usage_stats(http, tok):
    messages = [{"role": "user", "content": QUESTION}]
    events = stream(http, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *chunks, last = events
    prompt_tokens = len(chat_ids(tok, messages))
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 4, 5], "the role chunk counts 0"
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in events)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    assert last["usage"]["total_tokens"] == prompt_tokens + 5


# ------------------------------------------------------------------ sampling parameters


def test_logit_bias_min_p_and_stop_strings_reach_the_sampler(oai, tok):
    banana = tok.encode(" banana")[0]
    forced = greedy(oai, PROMPT, 4, logit_bias={str(banana): 100}, return_token_ids=True)
    assert forced.choices[0].token_ids == [banana] * 4
    base = greedy(oai, PROMPT, 8, return_token_ids=True)
    first = base.choices[0].token_ids[0]
    banned = greedy(oai, PROMPT, 8, logit_bias={str(first): -100}, return_token_ids=True)
    assert banned.choices[0].token_ids[0] != first
    # min_p=1 keeps only the most likely token: any temperature and seed samples the greedy text
    for seed in (1, 2):
        kept = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=seed,
                                      extra_body={"ignore_eos": True, "min_p": 1.0})
        assert kept.choices[0].text == base.choices[0].text
    words = [m for m in re.finditer(r"[A-Za-z]{3,}", base.choices[0].text) if m.start() > 0]
    assert words, base.choices[0].text
    word = words[0]
    kept_stop = greedy(oai, PROMPT, 8, stop=[word.group()], include_stop_str_in_output=True)
    assert kept_stop.choices[0].text == base.choices[0].text[:word.end()]
    assert kept_stop.choices[0].finish_reason == "stop"


def test_penalties_change_a_repetitive_continuation(oai):
    prompt = "one two one two one two one two one two one two one two"
    base = greedy(oai, prompt, 8).choices[0].text
    assert base.count("two") >= 3, f"the unpenalized continuation repeats the prompt: {base!r}"
    for extra in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert greedy(oai, prompt, 8, **extra).choices[0].text != base, extra


BAD_SAMPLING = [
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -2.01}, "frequency_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"repetition_penalty": -1.0}, "repetition_penalty"),
    ("/v1/chat/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {" 5": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "high"}}, "logit_bias"),
    ("/v1/completions", {"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"best_of": 65, "prompt": ["a", "b"]}, "best_of"),
    ("/v1/completions", {"echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"add_generation_prompt": "no"}, "add_generation_prompt"),
]


@pytest.mark.parametrize("path,fields,param", BAD_SAMPLING,
                         ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD_SAMPLING)])
def test_bad_parameters_are_400s_naming_them(http, path, fields, param):
    base = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    err = check_error(http.post(path, json=base | {"max_tokens": 1} | fields), 400, param)
    assert err["type"] == "invalid_request_error"


def test_the_openai_client_gets_typed_errors_and_the_server_keeps_serving(oai):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=1, frequency_penalty=3.0)
    assert bad.value.body["param"] == "frequency_penalty"
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias={"not-a-token": 5})
    assert bad.value.body["param"] == "logit_bias"
    assert greedy(oai, "x", 2).usage.completion_tokens == 2


# ------------------------------------------------------------------ best_of, logprobs with n and streams


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(oai):
    args = {"model": MODEL, "prompt": "My favourite fruit is", "max_tokens": 6, "temperature": 1.2, "seed": 11,
            "extra_body": {"ignore_eos": True}}
    every = oai.completions.create(n=4, logprobs=0, **args)  # the same 4 samples: seeds 11..14
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    ranked = [every.choices[i].text for i in sorted(range(4), key=lambda i: -scores[i])]
    assert len(set(ranked)) > 1, "the samples differ"
    best = oai.completions.create(n=2, best_of=4, **args)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == ranked[:2]
    assert all(c.logprobs is None for c in best.choices), "no logprobs the client did not ask for"
    assert best.usage.completion_tokens == 4 * 6, "every sample generated counts"
    one = oai.completions.create(best_of=4, logprobs=1, **args)
    assert [c.text for c in one.choices] == ranked[:1]
    assert len(one.choices[0].logprobs.top_logprobs) == 6


def test_logprobs_with_n_and_streaming(http, oai):
    body = {"prompt": ["One", "Two"], "max_tokens": 4, "temperature": 0, "n": 2, "logprobs": 2, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()
    events = stream(http, "/v1/completions", body)
    assert len(whole["choices"]) == 4
    for choice in whole["choices"]:
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == choice["index"]]
        tokens = [t for c in mine for t in c["logprobs"]["tokens"]]
        assert tokens == choice["logprobs"]["tokens"] and "".join(tokens) == choice["text"]
        streamed = [v for c in mine for v in c["logprobs"]["token_logprobs"]]
        assert streamed == pytest.approx(choice["logprobs"]["token_logprobs"])
        offsets = [o for c in mine for o in c["logprobs"]["text_offset"]]
        assert offsets == choice["logprobs"]["text_offset"]
        assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"])
    chat = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=4, temperature=0, n=2, logprobs=True, top_logprobs=2,
                                            stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chat if c.choices[0].index == index]
        assert mine[0].logprobs is None, "the role chunk carries no logprobs"
        entries = [e for c in mine[1:] for e in c.logprobs.content]
        assert "".join(e.token for e in entries) == "".join(c.delta.content or "" for c in mine)
        assert all(len(e.top_logprobs) == 2 for e in entries)


# ------------------------------------------------------------------ echo and chat template switches


def test_completion_echo(http, oai, tok):
    plain = greedy(oai, PROMPT, 6).choices[0].text
    echoed = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + plain
    assert echoed.usage.completion_tokens == 6
    ids = tok.encode(PROMPT)
    by_ids = oai.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == tok.decode(ids) + plain
    events = stream(http, "/v1/completions", {"prompt": [PROMPT, "Two"], "n": 2, "max_tokens": 3, "temperature": 0,
                                              "ignore_eos": True, "echo": True})
    plain = {p: greedy(oai, p, 3).choices[0].text for p in (PROMPT, "Two")}
    for index, prompt in enumerate([PROMPT, PROMPT, "Two", "Two"]):
        mine = [e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == index]
        assert len(mine) == 3 and mine[0].startswith(prompt), "the prompt comes with the first token"
        assert "".join(mine) == prompt + plain[prompt]


def test_chat_continue_final_message_and_echo(http, oai, tok):
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The capital of France is"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    want_ids = chat_ids(tok, messages, **flags)
    oracle = greedy(oai, want_ids, 4).choices[0].text
    resp = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True, "echo": True, "return_token_ids": True} | flags)
    assert resp.prompt_token_ids == want_ids
    assert resp.choices[0].message.content == messages[-1]["content"] + oracle
    assert resp.usage.prompt_tokens == len(want_ids)
    events = stream(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0,
                                                   "ignore_eos": True, "echo": True} | flags)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": messages[-1]["content"]}, "the echo comes right after the role"
    assert "".join(d.get("content", "") for d in deltas) == messages[-1]["content"] + oracle
    # no echo when the last message is the user's; add_generation_prompt=false leaves the header out
    bare = oai.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=2, temperature=0,
                                       extra_body={"echo": True, "add_generation_prompt": False,
                                                   "chat_template_kwargs": {"unused_variable": True}})
    assert bare.usage.prompt_tokens == len(chat_ids(tok, messages[:1], add_generation_prompt=False))
    assert not bare.choices[0].message.content.startswith(QUESTION)


# ------------------------------------------------------------------ return_token_ids, truncate_prompt_tokens


def test_return_token_ids(http, oai, tok):
    resp = greedy(oai, PROMPT, 5, return_token_ids=True)
    choice = resp.choices[0]
    assert choice.prompt_token_ids == tok.encode(PROMPT) and len(choice.token_ids) == 5
    assert tok.decode(choice.token_ids) == choice.text
    events = stream(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                              "ignore_eos": True, "return_token_ids": True})
    assert events[0]["choices"][0]["prompt_token_ids"] == choice.prompt_token_ids
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == choice.token_ids
    messages = [{"role": "user", "content": QUESTION}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0,
                                                   "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == chat_ids(tok, messages)
    assert tok.decode(chat["choices"][0]["token_ids"], skip_special_tokens=True) == chat["choices"][0]["message"][
        "content"]
    events = stream(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0,
                                                   "return_token_ids": True})
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]
    absent = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()
    assert "token_ids" not in absent["choices"][0] and "prompt_token_ids" not in absent["choices"][0]


def test_truncate_prompt_tokens_keeps_the_last_tokens(oai, tok):
    ids = tok.encode(PROMPT)
    keep = 8
    oracle = greedy(oai, ids[-keep:], 4).choices[0].text
    for prompt in (PROMPT, ids):
        resp = greedy(oai, prompt, 4, truncate_prompt_tokens=keep, return_token_ids=True)
        assert resp.usage.prompt_tokens == keep and resp.choices[0].prompt_token_ids == ids[-keep:]
        assert resp.choices[0].text == oracle
    # a prompt longer than the context fits once cut; -1 keeps what the context holds
    long_text = "a b " * 400
    assert len(tok.encode(long_text)) > MAX_MODEL_LEN
    cut = greedy(oai, long_text, 2, truncate_prompt_tokens=MAX_MODEL_LEN - 2)
    assert cut.usage.prompt_tokens == MAX_MODEL_LEN - 2
    echoed = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": keep})
    assert echoed.choices[0].text.startswith(tok.decode(ids[-keep:])), "echo shows what was kept"
    whole = greedy(oai, PROMPT, 2, truncate_prompt_tokens=-1)
    assert whole.usage.prompt_tokens == len(ids)
    messages = [{"role": "user", "content": QUESTION}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"truncate_prompt_tokens": keep})
    assert chat.usage.prompt_tokens == keep


def test_the_messages_api_takes_the_key_as_anthropic_clients_send_it(url):
    """Anthropic's clients send `x-api-key`, not a bearer token: either is the key; a wrong
    one, or none, is a 401."""
    import anthropic

    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=TIMEOUT) as claude:
        assert claude.messages.create(**body).usage.output_tokens == 1
    with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0, timeout=TIMEOUT) as claude:
        with pytest.raises(anthropic.AuthenticationError):
            claude.messages.create(**body)
    assert httpx.post(f"{url}/v1/messages", json=body, timeout=30).status_code == 401
    assert httpx.post(f"{url}/v1/messages", json=body, headers=AUTH, timeout=30).status_code == 200
