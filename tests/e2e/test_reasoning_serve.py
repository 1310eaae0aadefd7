"""Reasoning content through a real `meshserve serve --reasoning-parser deepseek_r1` and the
real `openai` client. A thinking_token_budget ends the reasoning (its free text) with a forced
`</think>`, after which the request's constraint shapes the answer: the reply comes back
split, `reasoning_content` and `content`, whole and streamed alike, with its reasoning tokens
counted in the usage; a forced tool call waits for the reasoning too; a reply cut off before
`</think>` is all reasoning; chat_template_kwargs reach the template. The Responses API gives
the reasoning as a `reasoning` item and the Messages API (the real `anthropic` client) as a
`thinking` block, whole and streamed, equal to chat's."""

from __future__ import annotations

import json
import re

from support.server import http_server, openai_client

MODEL = "smollm2-135m-instruct"
ANSWER = r"[A-Z][a-z]{2,8}\."
BUDGET = 4
TOOL = {"type": "function", "function": {"name": "find_city", "parameters": {
    "type": "object", "properties": {"country": {"type": "string", "maxLength": 12}}, "required": ["country"]}}}


def test_reasoning_is_split_off_whole_and_streamed(tmp_path):
    with http_server(tmp_path, "model.max_model_len=512", "cache.memory=32MiB",
                     args=("--reasoning-parser", "deepseek_r1")) as (_, url), openai_client(url, 120) as oai:
        ask = [{"role": "user", "content": "Think, then name a city."}]
        kw = dict(model=MODEL, messages=ask, max_tokens=40, temperature=0,
                  extra_body={"structured_outputs": {"regex": ANSWER}, "thinking_token_budget": BUDGET,
                              "chat_template_kwargs": {"enable_thinking": True}})
        whole = oai.chat.completions.create(**kw)
        reasoning, content = whole.choices[0].message.reasoning_content, whole.choices[0].message.content
        assert reasoning and "</think>" not in reasoning and re.fullmatch(ANSWER, content), whole.choices[0].message
        # the budget's tokens, then those of `</think>`; the answer's are the rest
        spent = whole.usage.completion_tokens_details.reasoning_tokens
        assert BUDGET < spent <= BUDGET + len("</think>") < whole.usage.completion_tokens, whole.usage

        got = {"reasoning_content": "", "content": ""}
        for chunk in oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            for choice in chunk.choices:
                got["reasoning_content"] += getattr(choice.delta, "reasoning_content", None) or ""
                got["content"] += choice.delta.content or ""
            if chunk.usage is not None:
                assert chunk.usage.completion_tokens_details.reasoning_tokens == spent
        assert got == {"reasoning_content": reasoning, "content": content}

        called = oai.chat.completions.create(**kw | {"tools": [TOOL], "tool_choice": "required", "max_tokens": 80,
                                                     "extra_body": {"thinking_token_budget": BUDGET}})
        message = called.choices[0].message
        assert message.reasoning_content and called.choices[0].finish_reason == "tool_calls", message
        assert message.tool_calls[0].function.name == "find_city"
        assert isinstance(json.loads(message.tool_calls[0].function.arguments)["country"], str)

        cut = oai.chat.completions.create(**kw | {"max_tokens": 2}).choices[0]
        assert cut.finish_reason == "length" and cut.message.content is None and cut.message.reasoning_content

        # a budget alone bounds an otherwise unconstrained reply
        free = oai.chat.completions.create(**kw | {"extra_body": {"thinking_token_budget": 2}})
        assert free.usage.completion_tokens_details.reasoning_tokens <= 2 + len("</think>")

        responses_api(oai, reasoning, spent)
        messages_api(url, reasoning)


def responses_api(oai, reasoning: str, spent: int):
    """The same prompt and budget (greedy) reason alike, here as a `reasoning` output item."""
    kw = dict(model=MODEL, input="Think, then name a city.", max_output_tokens=40, temperature=0,
              text={"format": {"type": "json_object"}}, extra_body={"thinking_token_budget": BUDGET})
    r = oai.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message"], r.output
    assert r.output[0].content[0].text == reasoning and isinstance(json.loads(r.output_text), dict)
    assert r.usage.output_tokens_details.reasoning_tokens == spent
    events = list(oai.responses.create(stream=True, **kw))
    done = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [reasoning]
    assert done.output[0].content[0].text == reasoning and done.output_text == r.output_text


def messages_api(url: str, reasoning: str):
    """Anthropic's `thinking` with a budget: the reasoning as a `thinking` block."""
    import anthropic

    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120) as claude:
        kw = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Think, then name a city."}],
                  thinking={"type": "enabled", "budget_tokens": BUDGET}, extra_body={"temperature": 0})
        m = claude.messages.create(**kw)
        assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == reasoning, m.content
        with claude.messages.stream(**kw) as stream:
            streamed = stream.get_final_message()
        assert [b.type for b in streamed.content] == ["thinking", "text"]
        assert streamed.content[0].thinking == reasoning and streamed.content[1].text == m.content[1].text
        plain = claude.messages.create(**kw | {"thinking": {"type": "disabled"}, "max_tokens": 2})
        assert plain.content[0].type == "thinking"  # deepseek_r1: the reply starts inside its reasoning
