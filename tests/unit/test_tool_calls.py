"""OpenAI tool calling's model side (engine/serving/tools). Oracles: calls written in a
format parse back to themselves; the streamed deltas, joined, equal parse() of the whole
text for any split of it (one character at a time included), malformed calls included; a
call's arguments stream as the model writes them, and a call broken after it committed ends
there;
the prompt rendered through the real SmolLM2 chat template carries the tools, the earlier
call and its result; any text a forced-call constraint admits parses to exactly one call
whose arguments jsonschema (a validator nobody here wrote) accepts against the tool's
parameters; bad tools/tool_choice are refused naming the parameter."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshserve.engine.serving.tools import (
    HERMES, LLAMA3_JSON, ParsedMessage, ToolRequestError, forced_call, render_messages, template_uses_tools,
    tool_format_for, validate_tool_request,
)

FORMATS = [HERMES, LLAMA3_JSON]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"$ref": "#/$defs/Query"}},
                                     "required": ["query"], "additionalProperties": False,
                                     "$defs": {"Query": {"type": "string", "minLength": 1}}}}}
NO_ARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, SEARCH, NO_ARGS]


def calls_of(msg: ParsedMessage) -> list[tuple[str, object]]:
    """(name, decoded arguments) of each call, after checking the OpenAI shape."""
    for c in msg.tool_calls:
        assert CALL_ID.fullmatch(c["id"]) and c["type"] == "function" and set(c["function"]) == {"name", "arguments"}
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.tool_calls]


def raw_calls(msg: ParsedMessage) -> list[tuple[str, str]]:
    """(name, arguments as written) of each call."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in msg.tool_calls]


def streamed(fmt, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """(content, (name, arguments text) of each call, deltas) of the stream fed `pieces`,
    checking the delta shapes."""
    stream, deltas = fmt.stream(), []
    for p in pieces:
        deltas += stream.feed(p)
    deltas += stream.finish()
    content, names, args = "", {}, {}
    for d in deltas:
        assert len(d) == 1 and (d.get("content") or d.get("tool_calls")), d
        if "content" in d:
            content += d["content"]
            continue
        [tc] = d["tool_calls"]
        i = tc["index"]
        if "id" in tc:  # a call's first fragment names it, once, in index order
            assert i == len(names) and CALL_ID.fullmatch(tc["id"]) and tc["type"] == "function"
            assert tc["function"]["arguments"] == ""
            names[i], args[i] = tc["function"]["name"], ""
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            args[i] += tc["function"]["arguments"]
    assert stream.num_calls == len(names)
    return content, [(names[i], args[i]) for i in sorted(names)], deltas


def assert_stream_matches_parse(fmt, text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    msg = fmt.parse(text)
    content, calls, _ = streamed(fmt, pieces)
    assert content == (msg.content or "") and calls == raw_calls(msg)


# ---------------------------------------------------------------- choosing a format

@pytest.mark.parametrize("template, fmt", [
    (None, HERMES),
    ("{{ messages }}", HERMES),
    ("{%- for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>", HERMES),
    ("{{- '<|python_tag|>' + tool_call.name }}", LLAMA3_JSON),
    ("{%- elif message.role == 'ipython' %}", LLAMA3_JSON),
    ("{% if x %}ipythonic{% endif %}", HERMES),
])
def test_format_follows_the_template(template, fmt):
    assert tool_format_for(template) is fmt


# ---------------------------------------------------------------- parse


def hermes_call(name, arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n</tool_call>'


HERMES_CASES = [
    (hermes_call("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    (hermes_call("a", {}) + "\n" + hermes_call("b", {"n": [1, 2.5, None, True]}), None,
     [("a", {}), ("b", {"n": [1, 2.5, None, True]})]),
    ("Let me look.\n\n" + hermes_call("a", {"x": 1}) + "\nDone.", "Let me look.\n\n\nDone.", [("a", {"x": 1})]),
    ('<tool_call>{"name": "wëtter_☂", "arguments": {"q": "say \\"hi\\" \\u00e9 😀\\n"}}</tool_call>', None,
     [("wëtter_☂", {"q": 'say "hi" é 😀\n'})]),
    (hermes_call("a", {"s": "</tool_call> <tool_call>"}), None, [("a", {"s": "</tool_call> <tool_call>"})]),
    ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n', None, [("a", {"x": 1})]),  # stopped before the marker
    ('<tool_call>{"name": "a", "parameters": {}}</tool_call>', None, [("a", {})]),
    ("plain answer with <b>tags</b> and {json}", "plain answer with <b>tags</b> and {json}", []),
]
HERMES_REFUSED = [  # not calls: left as content
    '<tool_call>{"name": "a", "arguments": "{}"}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "a", "extra": 1, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "a"}</tool_call>',
    '<tool_call>{"name": "a", "argum',
    "<tool_call>not json</tool_call>",
    '<tool_call>["a", {}]</tool_call>',
]
HERMES_BROKEN = [  # committed (name and the arguments' `{` seen), then broken: the call ends there
    ('<tool_call>{"name": "a", "arguments": {"x": }}</tool_call>', None, [("a", '{"x": ')]),
    ('<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call> after', "after", [("a", '{"x": ')]),
    ('<tool_call>{"name": "a", "arguments": {}, "extra": 1}</tool_call>', None, [("a", "{}")]),
    ('<tool_call>{"name": "a", "arguments": {}} trailing</tool_call>', "trailing</tool_call>", [("a", "{}")]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_cal', None, [("a", "{}")]),
    ('<tool_call>{"name": "a", "arguments": {"q": "cut sh', None, [("a", '{"q": "cut sh')]),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_parse(text, content, calls):
    msg = HERMES.parse(text)
    assert msg.content == content and calls_of(msg) == calls


@pytest.mark.parametrize("text", HERMES_REFUSED)
def test_hermes_text_that_cannot_be_a_call_stays_content(text):
    assert HERMES.parse(text) == ParsedMessage(text.strip(), [])
    assert HERMES.parse("Hi " + text + " bye").content == "Hi " + text + " bye"


@pytest.mark.parametrize("text, content, calls", HERMES_BROKEN)
def test_hermes_a_call_broken_after_it_committed_ends_there(text, content, calls):
    msg = HERMES.parse(text)
    assert msg.content == content and raw_calls(msg) == calls


def test_hermes_reads_the_calls_around_a_broken_one():
    bad = '<tool_call>{"name": "b", "arguments": {,}}</tool_call>'
    msg = HERMES.parse(hermes_call("a", {}) + bad + hermes_call("c", {"k": "v"}))
    assert msg.content is None and raw_calls(msg) == [("a", "{}"), ("b", "{"), ("c", '{"k": "v"}')]
    # a marker inside a malformed call is scanned again
    msg = HERMES.parse('<tool_call>{"name": <tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert msg.content == '<tool_call>{"name":' and calls_of(msg) == [("a", {})]


LLAMA3_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}', None, [("a", {})]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "é"}};', None,
     [("a", {"x": 1}), ("b", {"y": "é"})]),
    ('Checking.<|python_tag|>{"name": "a", "parameters": {}};{"name": "b", "arguments": {}}', "Checking.",
     [("a", {}), ("b", {})]),
    ('{"name": "ünï", "parameters": {"q": "a \\"quoted\\" ; {x}"}}', None, [("ünï", {"q": 'a "quoted" ; {x}'})]),
    ('{"name": "a", "parameters": {}} and then text', "and then text", [("a", {})]),
    ('{"name": "a", "parameters": {}}; {"name": broken', '; {"name": broken', [("a", {})]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "a", "parameters": {"x": 1}', None, [("a", {"x": 1})]),  # cut short after its arguments
    ('{"name": "a", "parameters": {"x": 1]} then', "]} then", [("a", '{"x": 1')]),  # broken: the rest is text
    ('{"parameters": {"x": 1}, "name": "a"}', None, [("a", {"x": 1})]),
    ('<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    ('Use {"name": "a", "parameters": {}} like this', 'Use {"name": "a", "parameters": {}} like this', []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA3_CASES)
def test_llama3_parse(text, content, calls):
    msg = LLAMA3_JSON.parse(text)
    got = [(name, args if isinstance(want, str) else json.loads(args))
           for (name, args), (_, want) in zip(raw_calls(msg), calls)]
    assert msg.content == content and got == calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_parse_never_raises_on_odd_text(fmt):
    for text in ["", "   ", "<", "<tool_call>", "<|python_tag|>", "{", "}", ";", '"', "\\", "\x00", "{" * 300]:
        msg = fmt.parse(text)
        assert msg.tool_calls == [] and msg.content == text.strip()


@pytest.mark.parametrize("fmt", FORMATS)
def test_rendered_calls_parse_back(fmt):
    calls = [("get_weather", {"city": "Zürich", "note": 'a "b" </tool_call>;'}), ("now", {})]
    assert calls_of(fmt.parse(fmt.render_calls(calls))) == calls


# ---------------------------------------------------------------- stream

def test_stream_holds_only_a_possible_marker_and_streams_the_arguments_as_written():
    stream = HERMES.stream()
    assert stream.feed("Hello <to") == [{"content": "Hello"}]  # the space waits for text after it
    assert stream.feed("p") == [{"content": " <top"}]  # "<top" cannot start <tool_call>
    assert stream.feed(" and <tool_") == [{"content": " and"}]
    assert stream.feed('call>\n{"name": "a", "argu') == []  # not a call until its arguments begin
    [head], [body] = (d["tool_calls"] for d in stream.feed('ments": {"x": [1'))
    assert head["index"] == 0 and head["function"] == {"name": "a", "arguments": ""} and CALL_ID.fullmatch(head["id"])
    assert body == {"index": 0, "function": {"arguments": '{"x": [1'}}
    assert stream.feed(", 2]}}\n</tool_") == [{"tool_calls": [{"index": 0, "function": {"arguments": ", 2]}"}}]}]
    assert stream.feed("call>") == []
    # the space held before the call comes out with the text after it
    assert stream.feed(" ok ") == [{"content": "  ok"}] and stream.finish() == []


def test_arguments_written_before_the_name_stream_once_the_name_is_known():
    stream = HERMES.stream()
    assert stream.feed('<tool_call>{"arguments": {"x": 1}, "na') == []
    deltas = stream.feed('me": "a"}</tool_call>')
    assert [d["tool_calls"][0]["function"] for d in deltas] == [{"name": "a", "arguments": ""}, {"arguments": '{"x": 1}'}]


def test_stream_gives_back_a_malformed_call_as_content():
    stream = HERMES.stream()
    assert stream.feed('<tool_call>{"name": "a"') == []
    assert stream.feed(", 7") == [{"content": '<tool_call>{"name": "a", 7'}]  # refused at once


def test_llama3_stream_waits_for_the_first_character():
    stream = LLAMA3_JSON.stream()
    assert stream.feed("  ") == [] and stream.feed('{"name": "a", ') == []
    assert [d["tool_calls"][0]["function"] for d in stream.feed('"parameters": {}}')] == [
        {"name": "a", "arguments": ""}, {"arguments": "{}"}]
    assert stream.feed(" x") == [{"content": "x"}]


CASES = [(HERMES, t) for t, _, _ in HERMES_CASES + HERMES_BROKEN] + [(HERMES, t) for t in HERMES_REFUSED] + [
    (LLAMA3_JSON, t) for t, _, _ in LLAMA3_CASES]


@pytest.mark.parametrize("fmt, text", CASES)
def test_stream_one_character_at_a_time(fmt, text):
    assert_stream_matches_parse(fmt, text, list(text))
    assert_stream_matches_parse(fmt, text, [text])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=8)
dumps = st.sampled_from([
    lambda v: json.dumps(v), lambda v: json.dumps(v, ensure_ascii=False),
    lambda v: json.dumps(v, indent=1), lambda v: json.dumps(v, separators=(",", ":"))])


@st.composite
def call_texts(draw, fmt):
    """The JSON of a call, sometimes broken (cut short, or a character put in)."""
    key = draw(st.sampled_from(["arguments", "parameters"]))
    text = draw(dumps)({"name": draw(names), key: draw(arguments)})
    mode = draw(st.sampled_from(["ok", "ok", "cut", "insert"]))
    at = draw(st.integers(0, len(text)))
    if mode == "cut":
        text = text[:at]
    elif mode == "insert":
        text = text[:at] + draw(st.sampled_from(list('{}[]",:;x< \\'))) + text[at:]
    if fmt is HERMES:
        return draw(st.sampled_from(["<tool_call>", "<tool_call>\n"])) + text + draw(
            st.sampled_from(["</tool_call>", "\n</tool_call>", "", "</tool_"]))
    return text


@st.composite
def model_outputs(draw, fmt):
    """Text, calls (good and bad), markers and separators in any order."""
    noise = st.lists(st.sampled_from(list("ab <>/{}[]\";:,\n\\|é_") + [
        "<tool_call>", "</tool_call>", "<|python_tag|>", "<|python"]), max_size=12).map("".join)
    runs = st.lists(call_texts(fmt), min_size=2, max_size=3).map(";\n".join)
    pieces = st.one_of(call_texts(fmt), runs, noise, st.sampled_from([";", " ; ", "\n", "<|python_tag|>"]))
    return "".join(draw(st.lists(pieces, max_size=6)))


@st.composite
def splits(draw, text):
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stream_matches_parse_for_any_split(fmt, data):
    text = data.draw(model_outputs(fmt))
    assert_stream_matches_parse(fmt, text, data.draw(splits(text)))
    assert_stream_matches_parse(fmt, text, list(text))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.text(st.sampled_from(list("ab \n.{}>;é"))), names, arguments), max_size=4),
       st.text(st.sampled_from(list("ab \n.")), max_size=5))
def test_hermes_calls_among_text_parse_to_themselves(chunks, tail):
    text = "".join(t + hermes_call(n, a) for t, n, a in chunks) + tail
    msg = HERMES.parse(text)
    assert calls_of(msg) == [(n, a) for _, n, a in chunks]
    assert (msg.content or "") == ("".join(t for t, _, _ in chunks) + tail).strip()


@settings(max_examples=150, deadline=None)
@given(st.text(st.sampled_from(list("ab .{}\n;é")), max_size=8), st.lists(st.tuples(names, arguments), min_size=1,
                                                                          max_size=3))
def test_llama3_calls_after_the_tag_parse_to_themselves(before, calls):
    msg = LLAMA3_JSON.parse(before + "<|python_tag|>" + LLAMA3_JSON.render_calls(calls))
    assert calls_of(msg) == calls and (msg.content or "") == before.strip()


# ---------------------------------------------------------------- render

def conversation(system: str | None = "Be brief."):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [
                call, {**call, "id": "call_2", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "25C"}]},
            {"role": "user", "content": "Thanks"}]
    return ([{"role": "system", "content": system}] if system else []) + msgs


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2):
    from meshserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(smollm2)


def test_fallback_renders_tools_calls_and_results_through_smollm2(smollm2_tokenizer):
    source = smollm2_tokenizer.chat_template
    assert not template_uses_tools(source) and tool_format_for(source) is HERMES
    msgs, kwargs = render_messages(conversation(), TOOLS, source, HERMES)
    assert kwargs == {} and all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in msgs)
    text = smollm2_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    for tool in TOOLS:
        assert "\n" + json.dumps(tool, ensure_ascii=False) + "\n" in text
    assert "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" in text
    assert ("<|im_start|>user\n<tool_response>\n22C\n</tool_response>\n<tool_response>\n25C\n</tool_response>"
            "<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n") in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert calls_of(HERMES.parse(turn)) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_fallback_without_a_system_message_puts_one_first():
    msgs, _ = render_messages(conversation(system=None), [WEATHER], None, LLAMA3_JSON)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Given the following functions")
    assert msgs[2] == {"role": "assistant", "content": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                                       '{"name": "get_weather", "parameters": {"city": "Rome"}}'}
    no_tools, _ = render_messages(conversation(system=None), None, None, HERMES)
    assert no_tools[0] == {"role": "user", "content": "Weather in Paris and Rome?"}


TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}
{%- elif m.role == 'tool' %}[{{ m.name }} {{ m.tool_call_id }}] {{ m.content }}
{%- else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}"""


def test_a_template_with_tools_gets_them_and_native_messages(smollm2_tokenizer):
    assert template_uses_tools(TOOLS_TEMPLATE)
    msgs, kwargs = render_messages(conversation(), TOOLS, TOOLS_TEMPLATE, tool_format_for(TOOLS_TEMPLATE))
    assert kwargs == {"tools": TOOLS} and msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[2]["tool_calls"][0] == {"id": "call_1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert msgs[2]["content"] == "" and msgs[4]["content"] == "25C"
    text = smollm2_tokenizer.apply_chat_template(msgs, chat_template=TOOLS_TEMPLATE, tokenize=False, **kwargs)
    assert json.dumps(WEATHER) in text and "# Tools" not in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in text
    assert "[get_weather call_1] 22C" in text


@pytest.mark.parametrize("arguments, message", [
    ("{not json", "is not valid JSON"), ("[1, 2]", "must be a JSON object"), ({"already": "a dict"}, None)])
def test_assistant_call_arguments_must_be_an_object(arguments, message):
    msgs = [{"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
    for template in (None, TOOLS_TEMPLATE):
        if message is None:
            assert render_messages(msgs, None, template, HERMES)[0][0]["role"] == "assistant"
            continue
        with pytest.raises(ToolRequestError, match=re.escape("messages[0].tool_calls[0].function.arguments")) as e:
            render_messages(msgs, None, template, HERMES)
        assert e.value.param == "messages" and message in str(e.value)


# ---------------------------------------------------------------- forced calls

def admitted(constraint, value) -> str:
    return constraint.prefix + json.dumps(value, ensure_ascii=False) + constraint.suffix


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_free_choices_need_no_constraint(choice):
    assert forced_call(TOOLS, choice, HERMES) is None and forced_call(None, choice, HERMES) is None


def test_forced_call_shapes():
    c = forced_call(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, HERMES)
    assert (c.prefix, c.suffix) == ("<tool_call>\n", "\n</tool_call>")
    assert c.schema == {"type": "object", "properties": {"name": {"const": "get_weather"},
                                                         "arguments": WEATHER["function"]["parameters"]},
                        "required": ["name", "arguments"], "additionalProperties": False}
    c = forced_call(TOOLS, "required", LLAMA3_JSON)
    assert (c.prefix, c.suffix) == ("", "") and len(c.schema["anyOf"]) == 3
    assert [s["properties"]["name"] for s in c.schema["anyOf"]] == [{"const": t["function"]["name"]} for t in TOOLS]
    assert c.schema["anyOf"][1]["properties"]["parameters"]["properties"]["query"] == {
        "$ref": "#/anyOf/1/properties/parameters/$defs/Query"}


CHOICES = ["required"] + [{"type": "function", "function": {"name": t["function"]["name"]}} for t in TOOLS]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: c if isinstance(c, str) else c["function"]["name"])
def test_forced_call_admits_exactly_valid_calls(fmt, choice):
    c = forced_call(TOOLS, choice, fmt)
    validator = jsonschema.Draft202012Validator(c.schema)
    jsonschema.Draft202012Validator.check_schema(c.schema)
    key = fmt.arguments_key
    samples = [{"name": "get_weather", key: {"city": "Zürich \"</tool_call>\"", "unit": "C"}},
               {"name": "search", key: {"query": "<tool_call>; x"}}, {"name": "now", key: {}},
               {"name": "search", key: {"query": ""}}, {"name": "get_weather", key: {"unit": "K"}},
               {"name": "nope", key: {}}, {"name": "now", key: {}, "extra": 1}, {"name": "now", key: []}]
    allowed = {choice["function"]["name"]} if isinstance(choice, dict) else {t["function"]["name"] for t in TOOLS}
    parameters = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}
    for value in samples:
        if not validator.is_valid(value):
            continue
        msg = fmt.parse(admitted(c, value))
        [(name, args)] = calls_of(msg)
        assert msg.content is None and name in allowed and args == value[key]
        jsonschema.validate(args, parameters[name])
    valid = [v for v in samples if validator.is_valid(v)]
    assert len(valid) == {"required": 3, "get_weather": 1, "search": 1, "now": 1}[
        choice if isinstance(choice, str) else choice["function"]["name"]]


@settings(max_examples=100, deadline=None)
@given(arguments, st.sampled_from(FORMATS))
def test_forced_call_any_arguments_parse_back(args, fmt):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    c = forced_call([tool], "required", fmt)
    value = {"name": "f", fmt.arguments_key: args}
    jsonschema.validate(value, c.schema)
    msg = fmt.parse(admitted(c, value))
    assert msg.content is None and calls_of(msg) == [("f", args)]


def test_forced_call_schema_compiles_for_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    accepts = getattr(pytest.importorskip("xgrammar.testing"), "_is_grammar_accept_string", None)
    if accepts is None:
        pytest.skip("this xgrammar has no _is_grammar_accept_string")
    c = forced_call(TOOLS, "required", HERMES)
    body = xgr.Grammar.from_json_schema(json.dumps(c.schema), any_whitespace=False)
    assert accepts(body, json.dumps({"name": "search", "arguments": {"query": "x"}}))
    assert not accepts(body, json.dumps({"name": "search", "arguments": {"query": ""}}))  # via the rebased $ref
    assert not accepts(body, json.dumps({"name": "nope", "arguments": {}}))


# ---------------------------------------------------------------- validation

def named(name):
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("tools, choice, param, message", [
    (TOOLS, named("missing"), "tool_choice",
     "tool_choice names function `missing`, which is not in tools (get_weather, search, now)"),
    (None, "required", "tool_choice", "tool_choice required needs tools"),
    ([], named("now"), "tool_choice", "tool_choice function `now` needs tools"),
    (TOOLS, "sometimes", "tool_choice", "tool_choice must be one of none, auto, required"),
    (TOOLS, {"type": "function", "function": {}}, "tool_choice", "a tool_choice object must be"),
    ([WEATHER, {"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}], None, "tools",
     'tools[1].function.parameters must be a JSON schema of an object ("type": "object"), got "type": \'string\''),
    ([{"type": "function", "function": {"name": "x", "parameters": "{}"}}], None, "tools",
     "tools[0].function.parameters must be a JSON schema object, got str"),
    ([WEATHER, NO_ARGS, WEATHER], "auto", "tools", "tools[0] and tools[2] both define a function named `get_weather`"),
    ([{"type": "retrieval"}], None, "tools", 'tools[0] must be {"type": "function"'),
    ([named("has space")], None, "tools", "tools[0].function.name must be 1-64 characters"),
    ({"not": "a list"}, None, "tools", "tools must be a list"),
])
def test_bad_tool_requests_name_the_parameter(tools, choice, param, message):
    with pytest.raises(ToolRequestError) as e:
        validate_tool_request(tools, choice)
    assert isinstance(e.value, ValueError) and e.value.param == param and message in str(e.value)
    with pytest.raises(ToolRequestError):
        forced_call(tools, choice if choice not in (None, "auto") else "required", HERMES)


@pytest.mark.parametrize("tools, choice", [(None, None), (None, "none"), (None, "auto"), ([], "auto"),
                                           (TOOLS, "required"), (TOOLS, named("now"))])
def test_good_tool_requests_pass(tools, choice):
    validate_tool_request(tools, choice)
