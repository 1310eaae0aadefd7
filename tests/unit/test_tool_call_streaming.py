"""Streamed tool calls agree with whole ones (issue: the peers' parsers give different
results streamed and whole, and drop arguments when one step yields several tokens or
calls). For random tool schemas, forced calls of each tool format (the text the forced-call
constraint admits, checked against its schema by jsonschema), one to three calls in one
output, tokenized by SmolLM2's tokenizer and streamed through the server's incremental
detokenizer 1 to 8 tokens a step: the streamed deltas, joined, equal parse() of the whole
text, which gives back the calls written; and each call's arguments arrive in pieces as they
are written, not in one piece at its end."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshserve.engine.serving.tools import HERMES, LLAMA3_JSON, forced_call

FORMATS = [HERMES, LLAMA3_JSON]
SEPARATORS = {HERMES.name: "\n", LLAMA3_JSON.name: "; "}
# what a model writes: ASCII (quotes, backslashes, braces, the markers' characters), accents,
# CJK, emoji, and characters JSON must escape
CHARACTERS = st.one_of(st.characters(min_codepoint=0x20, max_codepoint=0x7E),
                       st.sampled_from(list("éüß中文☂😀\n\t\u2028")))
SCALARS = {
    "string": st.text(CHARACTERS, max_size=12),
    "integer": st.integers(-10**6, 10**6),
    "number": st.floats(allow_nan=False, allow_infinity=False, width=32),
    "boolean": st.booleans(),
}


@st.composite
def schema_and_value(draw, depth: int = 0):
    """A JSON schema and a value it accepts."""
    kinds = list(SCALARS) + ["enum"] + (["array", "object"] if depth < 2 else [])
    kind = draw(st.sampled_from(kinds))
    if kind in SCALARS:
        return {"type": kind}, draw(SCALARS[kind])
    if kind == "enum":
        options = draw(st.lists(st.text(CHARACTERS, max_size=4), min_size=1, max_size=3, unique=True))
        return {"enum": options}, draw(st.sampled_from(options))
    if kind == "array":
        item = draw(st.sampled_from(list(SCALARS)))
        return {"type": "array", "items": {"type": item}}, draw(st.lists(SCALARS[item], max_size=4))
    return draw(object_schema_and_value(depth + 1))


@st.composite
def object_schema_and_value(draw, depth: int = 0):
    keys = draw(st.lists(st.text(CHARACTERS, min_size=1, max_size=6),
                         max_size=4, unique=True))
    pairs = {k: draw(schema_and_value(depth)) for k in keys}
    return ({"type": "object", "properties": {k: s for k, (s, _) in pairs.items()}, "required": keys,
             "additionalProperties": False}, {k: v for k, (_, v) in pairs.items()})


@st.composite
def forced_outputs(draw, fmt):
    """(tools, [(name, arguments)], the output text): each call as the constraint forcing
    it admits it, in one of the JSON spellings a grammar lets a model write."""
    tools, values = [], []
    for i in range(draw(st.integers(1, 3))):
        schema, value = draw(object_schema_and_value())
        name = draw(st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)) + str(i)
        tools.append({"type": "function", "function": {"name": name, "parameters": schema}})
        values.append((name, value))
    calls = draw(st.lists(st.sampled_from(values), min_size=1, max_size=3))
    spell = draw(st.sampled_from([dict(ensure_ascii=False), dict(ensure_ascii=True),
                                  dict(separators=(",", ":"), ensure_ascii=False)]))
    texts = []
    for name, value in calls:
        constraint = forced_call(tools, {"type": "function", "function": {"name": name}}, fmt)
        call = {"name": name, fmt.arguments_key: value}
        jsonschema.validate(call, constraint.schema)
        texts.append(constraint.prefix + json.dumps(call, **spell) + constraint.suffix)
    return tools, calls, SEPARATORS[fmt.name].join(texts)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from meshserve.configs.model_info import read_model_info
    from meshserve.engine.tokenizer import Tokenizer

    return Tokenizer(read_model_info(str(smollm2)))


def stream_steps(fmt, tokenizer, token_ids: list[int], steps: list[int]):
    """The stream's deltas, fed the detokenized text of `steps[k]` tokens at a time."""
    detok, stream, deltas, at = tokenizer.detokenizer([]), fmt.stream(), [], 0
    for k in steps:
        chunk, at = token_ids[at:at + k], at + k
        deltas.append(stream.feed("".join(detok.step(t) for t in chunk)))
        if at >= len(token_ids):
            break
    deltas.append(stream.finish())
    return deltas


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_streamed_calls_equal_whole_ones_for_any_tokens_per_step(fmt, tokenizer, data):
    _, calls, text = data.draw(forced_outputs(fmt))
    token_ids = tokenizer.encode_text(text, add_special_tokens=False)
    assert tokenizer.decode(token_ids) == text
    steps = data.draw(st.lists(st.integers(1, 8), min_size=len(token_ids), max_size=len(token_ids)))
    per_step = stream_steps(fmt, tokenizer, token_ids, steps)
    names, arguments, pieces, content = {}, {}, {}, ""
    for step in per_step:
        for d in step:
            content += d.get("content", "")
            for tc in d.get("tool_calls", []):
                i = tc["index"]
                if "id" in tc:
                    names[i], arguments[i], pieces[i] = tc["function"]["name"], "", 0
                arguments[i] += tc["function"]["arguments"]
                pieces[i] += bool(tc["function"]["arguments"])
    whole = fmt.parse(text)
    assert whole.content is None and content == ""
    assert [(names[i], arguments[i]) for i in sorted(names)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == [(n, v) for n, v in calls]
    # a call whose arguments span several steps streams them in several pieces
    for i, (_, value) in enumerate(calls):
        spanned = len(tokenizer.encode_text(json.dumps(value), add_special_tokens=False)) > 2 * max(steps)
        assert pieces[i] > 1 or not spanned, (i, arguments[i], steps)
