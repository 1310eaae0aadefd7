"""Reasoning content through a real `meshserve serve --reasoning-parser deepseek_r1` and the
real `openai` client: a reply forced (by a regex constraint) to reason, close `</think>` and
answer comes back split, `reasoning_content` and `content`, whole and streamed alike; a
reply cut off before `</think>` is all reasoning; chat_template_kwargs reach the template."""

from __future__ import annotations

import re

from support.server import http_server, openai_client

MODEL = "smollm2-135m-instruct"
THOUGHT = r"[a-z]{2,8}( [a-z]{2,8}){1,3}"
PATTERN = THOUGHT + r"</think>[A-Z][a-z]{2,8}\."


def test_reasoning_is_split_off_whole_and_streamed(tmp_path):
    with http_server(tmp_path, "model.max_model_len=512", "cache.memory=32MiB",
                     args=("--reasoning-parser", "deepseek_r1")) as (_, url), openai_client(url, 120) as oai:
        ask = [{"role": "user", "content": "Think, then name a city."}]
        kw = dict(model=MODEL, messages=ask, max_tokens=60, temperature=0,
                  extra_body={"structured_outputs": {"regex": PATTERN}, "chat_template_kwargs": {"enable_thinking": True}})
        whole = oai.chat.completions.create(**kw).choices[0]
        reasoning, content = whole.message.reasoning_content, whole.message.content
        assert re.fullmatch(THOUGHT, reasoning) and re.fullmatch(r"[A-Z][a-z]{2,8}\.", content), whole.message
        got = {"reasoning_content": "", "content": ""}
        for chunk in oai.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                got["reasoning_content"] += getattr(choice.delta, "reasoning_content", None) or ""
                got["content"] += choice.delta.content or ""
        assert got == {"reasoning_content": reasoning, "content": content}
        cut = oai.chat.completions.create(**kw | {"max_tokens": 2}).choices[0]
        assert cut.finish_reason == "length" and cut.message.content is None and cut.message.reasoning_content
