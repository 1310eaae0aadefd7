"""End to end: structured outputs, tool calling and prompt logprobs through a real
`meshserve serve` (built-in SmolLM2, one CPU rank), driven by the real `openai` package:
response_format (json_schema strict, json_object), vLLM's structured_outputs and guided_*,
tools with tool_choice auto / required / named, whole and streamed (the deltas reassembled),
tool results in the conversation, prompt_logprobs and echo with logprobs; the Responses API
(stored responses continued); Anthropic's Messages API through the real `anthropic` client
(text, stop sequences, tools and tool results, streamed events, an agent loop); bad input is
a 400 naming the parameter and the server keeps serving.

Oracles: jsonschema (a validator nobody here wrote) for every structured output and every
forced call's arguments; transformers' log-softmax for prompt logprobs; the same server's
unconstrained output for what a constraint must not change.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel

from support.reference import hf_logits
from support.schemas import CHOICES, PROMPTS, REGEX, SCHEMAS
from support.server import http_server, openai_client

MAX_MODEL_LEN = 1024
TIMEOUT = 300.0
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    with http_server(tmp_path_factory.mktemp("structured_http"), f"model.max_model_len={MAX_MODEL_LEN}",
                     "cache.memory=96MiB", "scheduler.max_num_seqs=16") as (proc, url):
        yield url
        assert proc.proc.poll() is None, f"the server died:\n{proc.tail()}"


@pytest.fixture(scope="module")
def oai(url) -> openai.OpenAI:
    with openai_client(url, TIMEOUT) as c:
        yield c


def chat(oai, messages, **kw):
    return oai.chat.completions.create(messages=messages, model="smollm2-135m-instruct", **kw)


@pytest.mark.slow
def test_response_format_json_schema_and_json_object(oai):
    for name in ("person", "order"):
        r = chat(oai, [{"role": "user", "content": PROMPTS[name]}], max_tokens=200, temperature=0,
                 response_format={"type": "json_schema",
                                  "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
    r = chat(oai, [{"role": "user", "content": "Describe a cat as JSON."}], max_tokens=80, temperature=0.7, seed=3,
             response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))


def test_openai_parse_helper_with_a_pydantic_model(oai):
    class City(BaseModel):
        name: str
        population_millions: float
        country: str

    r = oai.chat.completions.parse(model="smollm2-135m-instruct", max_tokens=120, temperature=0, response_format=City,
                                   messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    assert isinstance(r.choices[0].message.parsed, City)


def test_vllm_structured_outputs_and_guided_names_on_both_endpoints(oai):
    r = chat(oai, [{"role": "user", "content": "Pick a city."}], max_tokens=10, temperature=0.9, seed=1,
             extra_body={"structured_outputs": {"choice": CHOICES}})
    assert r.choices[0].message.content in CHOICES
    r = chat(oai, [{"role": "user", "content": "A city and a number."}], max_tokens=20, temperature=0,
             extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, r.choices[0].message.content)
    c = oai.completions.create(model="smollm2-135m-instruct", prompt="My favourite city is", max_tokens=10,
                               temperature=0, extra_body={"guided_choice": CHOICES})
    assert c.choices[0].text in CHOICES
    c = oai.completions.create(model="smollm2-135m-instruct", prompt="A sentiment as JSON:", max_tokens=120,
                               temperature=0, extra_body={"guided_json": SCHEMAS["sentiment"]})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMAS["sentiment"])
    grammar = 'root ::= "yes" | "no"'
    c = oai.completions.create(model="smollm2-135m-instruct", prompt="Is Paris in France?", max_tokens=5,
                               temperature=0, extra_body={"structured_outputs": {"grammar": grammar}})
    assert c.choices[0].text in ("yes", "no")


def test_a_constrained_and_an_unconstrained_request_share_steps(oai):
    """n=1 requests sent together: the unconstrained one gets exactly what it gets alone."""
    import concurrent.futures

    plain = dict(max_tokens=24, temperature=0)
    alone = chat(oai, ASK, **plain).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, oai, ASK, **plain)] + [
            pool.submit(chat, oai, [{"role": "user", "content": PROMPTS["sentiment"]}], max_tokens=120,
                        temperature=0, response_format={"type": "json_schema", "json_schema": {
                            "name": "s", "schema": SCHEMAS["sentiment"]}}) for _ in range(3)]
        results = [f.result() for f in futures]
    assert results[0].choices[0].message.content == alone
    for r in results[1:]:
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["sentiment"])


def check_call(call, tool):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_choice_required_and_named_always_call(oai):
    r = chat(oai, ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=120, temperature=0.8, seed=5)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    check_call(msg.tool_calls[0], WEATHER if msg.tool_calls[0].function.name == "get_weather" else ADD)
    r = chat(oai, [{"role": "user", "content": "What is 2 plus 3?"}], tools=[WEATHER, ADD], max_tokens=120,
             temperature=0, tool_choice={"type": "function", "function": {"name": "add"}})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    check_call(r.choices[0].message.tool_calls[0], ADD)


def test_streamed_tool_call_deltas_reassemble_to_the_whole_reply(oai):
    kw = dict(tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0)
    whole = chat(oai, ASK, **kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(oai, ASK, stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None, "pieces": 0})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
                entry["pieces"] += bool(d.function and d.function.arguments)
    assert finish == "tool_calls" and len(calls) == 1
    want = whole.message.tool_calls[0].function
    assert calls[0]["name"] == want.name and calls[0]["arguments"] == want.arguments
    assert calls[0]["pieces"] > 3, "the arguments stream as the model writes them, as OpenAI's do"
    with oai.chat.completions.stream(model="smollm2-135m-instruct", messages=ASK, **kw) as stream:
        argument_events = sum(e.type == "tool_calls.function.arguments.delta" for e in stream)
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.name == "get_weather" and argument_events > 3
    jsonschema.validate(json.loads(final.choices[0].message.tool_calls[0].function.arguments),
                        WEATHER["function"]["parameters"])


def test_tool_choice_auto_and_none_and_a_tool_result_turn(oai):
    r = chat(oai, ASK, tools=[WEATHER], tool_choice="auto", max_tokens=60, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:  # a 135M model may or may not call: either way a well-formed reply
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "get_weather"
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    r = chat(oai, ASK, tools=[WEATHER], tool_choice="none", max_tokens=20, temperature=0)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = chat(oai, turn, tools=[WEATHER], max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_prompt_logprobs_and_echo_with_logprobs_match_transformers(url, smollm2_reference):
    prompt = "The capital of France is"
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        body = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                                   "prompt_logprobs": 2, "echo": True, "logprobs": 1}).json()
        ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    want = torch.log_softmax(hf_logits(smollm2_reference, ids), dim=-1)
    choice = body["choices"][0]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        entry = got[pos][str(ids[pos])]
        assert entry["logprob"] == pytest.approx(float(want[pos - 1, ids[pos]]), abs=2e-3)
    legacy = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert legacy["token_logprobs"][0] is None and len(legacy["tokens"]) == len(ids) + 2
    assert legacy["token_logprobs"][1] == pytest.approx(float(want[0, ids[1]]), abs=2e-3)
    assert "".join(legacy["tokens"][:len(ids)]) == prompt


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"thinking_token_budget": 8}, "thinking_token_budget"),  # this server has no reasoning parser
    ({"thinking_token_budget": 0}, "thinking_token_budget"),
])
def test_bad_input_is_a_400_naming_the_parameter_and_the_server_keeps_serving(url, body, param):
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2} | body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        ok = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
        assert ok.status_code == 200


def test_responses_api_text_tools_and_structured_text(oai):
    r = oai.responses.create(model="smollm2-135m-instruct", input="Say hello.", instructions="Be brief.",
                             max_output_tokens=12, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    chat_reply = chat(oai, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
                      max_tokens=12, temperature=0).choices[0].message.content
    assert r.output_text == chat_reply  # the same generation as chat's
    tool = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
            "parameters": WEATHER["function"]["parameters"]}
    r = oai.responses.create(model="smollm2-135m-instruct", input="What is the weather in Paris?", tools=[tool],
                             tool_choice="required", max_output_tokens=120, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
    follow = oai.responses.create(
        model="smollm2-135m-instruct", tools=[tool], max_output_tokens=20, temperature=0,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'}])
    assert follow.status in ("completed", "incomplete")

    class Mood(BaseModel):
        label: str
        score: float

    parsed = oai.responses.parse(model="smollm2-135m-instruct", input="Rate the mood of 'I love it' as JSON.",
                                 text_format=Mood, max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Mood)


def test_responses_api_streaming_events(oai):
    kinds, text, done = [], "", None
    seqs = []
    with oai.responses.stream(model="smollm2-135m-instruct", input="Count to three.", max_output_tokens=16,
                              temperature=0) as stream:
        for event in stream:
            kinds.append(event.type)
            seqs.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                text += event.delta
        done = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert seqs == list(range(len(seqs)))
    assert text == done.output_text and text
    whole = oai.responses.create(model="smollm2-135m-instruct", input="Count to three.", max_output_tokens=16,
                                 temperature=0)
    assert whole.output_text == text


def test_responses_api_continues_a_stored_response_and_gives_logprobs(oai, url):
    """store / previous_response_id: the follow-up is the chat of the whole conversation (its
    instructions its own), its prompt found in the prefix cache; retrieve and delete; a
    response stored under one API key is not found under another; store=false keeps nothing;
    include/top_logprobs give the output's logprobs; unhonoured fields are named."""
    model = "smollm2-135m-instruct"
    first = oai.responses.create(model=model, input="My name is Ada.", instructions="Be brief.", max_output_tokens=8,
                                 temperature=0)
    assert first.store is True and first.output_text
    follow = oai.responses.create(model=model, previous_response_id=first.id, input="What is my name?",
                                  instructions="Be brief.", max_output_tokens=8, temperature=0)
    assert follow.previous_response_id == first.id
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "My name is Ada."},
                    {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}]
    assert follow.output_text == chat(oai, conversation, max_tokens=8, temperature=0).choices[0].message.content
    assert follow.usage.input_tokens_details.cached_tokens >= 16, "the conversation's start is cached"
    with oai.responses.stream(model=model, previous_response_id=follow.id, input="And again?", max_output_tokens=4,
                              temperature=0) as stream:
        streamed = stream.get_final_response()
    assert oai.responses.retrieve(streamed.id).output_text == streamed.output_text
    assert oai.responses.retrieve(first.id).output_text == first.output_text
    with httpx.Client(base_url=url, timeout=TIMEOUT, headers={"Authorization": "Bearer someone-else"}) as other:
        assert other.get(f"/v1/responses/{first.id}").status_code == 404
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        oai.responses.create(model=model, previous_response_id=first.id, input="hi", max_output_tokens=2)
    unstored = oai.responses.create(model=model, input="hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=model, previous_response_id=unstored.id, input="hi", max_output_tokens=2)
    scored = oai.responses.create(model=model, input="Count to three.", include=["message.output_text.logprobs"],
                                  top_logprobs=2, max_output_tokens=5, temperature=0)
    part = scored.output[0].content[0]
    assert len(part.logprobs) == scored.usage.output_tokens == 5
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-4 for lp in part.logprobs)
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "low"},
                                             "include": ["reasoning.encrypted_content"]})
        assert r.status_code == 200 and r.headers["x-meshserve-ignored-fields"] == (
            "include[reasoning.encrypted_content], reasoning")


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
])
def test_responses_api_bad_input(url, body, param):
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        r = http.post("/v1/responses", json=body | {"max_output_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


# ---------------------------------------------------------------- Anthropic's Messages API

@pytest.fixture(scope="module")
def claude(url):
    import anthropic

    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        yield c


GREEDY = {"temperature": 0}
"""Sent as extra fields: this anthropic client has no temperature argument any more."""
TOOL = {"name": "get_weather", "description": "The current weather in a city.",
        "input_schema": WEATHER["function"]["parameters"]}


def test_messages_api_text_and_stop_sequences_match_chat(oai, claude):
    system, ask = "Be brief.", [{"role": "user", "content": "Say hello to the world."}]
    reply = claude.messages.create(model="smollm2-135m-instruct", max_tokens=16, system=system, messages=ask,
                                   extra_body=GREEDY)
    expected = chat(oai, [{"role": "system", "content": system}] + ask, max_tokens=16, extra_body=GREEDY).choices[0]
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == expected.message.content
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.finish_reason]
    assert reply.usage.output_tokens == 16 or reply.stop_reason == "end_turn"
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) > 5
    word = reply.content[0].text.split()[1]
    stopped = claude.messages.create(model="smollm2-135m-instruct", max_tokens=16, system=system, messages=ask,
                                     stop_sequences=[word], extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert reply.content[0].text.startswith(stopped.content[0].text) and word not in stopped.content[0].text
    with claude.messages.stream(model="smollm2-135m-instruct", max_tokens=16, system=system, messages=ask,
                                extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == reply.content[0].text == final.content[0].text and final.stop_reason == reply.stop_reason


def test_messages_api_tools_streamed_and_an_agent_loop(claude):
    """A forced tool_use, whole and streamed (its input_json_delta events as the model writes
    them, reassembled by the client into the same input), then the agent loop's next turn
    with the tool_result."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="smollm2-135m-instruct", max_tokens=120, tools=[TOOL], extra_body=GREEDY)
    reply = claude.messages.create(messages=ask, tool_choice={"type": "tool", "name": "get_weather"}, **kw)
    [use] = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, TOOL["input_schema"])
    deltas = 0
    with claude.messages.stream(messages=ask, tool_choice={"type": "tool", "name": "get_weather"}, **kw) as stream:
        for event in stream:
            deltas += event.type == "content_block_delta" and event.delta.type == "input_json_delta"
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert deltas > 3 and streamed.input == use.input and final.stop_reason == "tool_use"
    turn = ask + [{"role": "assistant", "content": reply.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": '{"temperature": 21, "sky": "clear"}'}]}]
    answer = claude.messages.create(messages=turn, **kw)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content


def test_messages_api_bad_input_is_an_anthropic_error_and_the_server_keeps_serving(url, claude):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="smollm2-135m-instruct", max_tokens=4,
                               messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        r = http.post("/v1/messages", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    ok = claude.messages.create(model="smollm2-135m-instruct", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert ok.usage.output_tokens <= 2
