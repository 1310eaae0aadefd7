"""The openai client against meshserve: structured outputs and tool calling. Run by
scripts/outside_clients.py with the client's own virtual environment: python openai_checks.py URL MODEL."""

import json
import re

import openai
from common import ASK, MODEL, TOOL_ASK, URL, Sum, check, need, report
from pydantic import BaseModel

client = openai.OpenAI(base_url=URL, api_key="unused", max_retries=0, timeout=300)
LIMITS = {"model": MODEL, "max_tokens": 128, "temperature": 0}
MESSAGES = [{"role": "user", "content": ASK}]
TOOL_MESSAGES = [{"role": "user", "content": TOOL_ASK}]
ADD = {"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
CALLED = [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function",
           "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
          {"role": "tool", "tool_call_id": "call_0", "content": "5"}]


class Add(BaseModel):
    """Adds two integers."""
    a: int
    b: int


def create(**kwargs):
    """One chat completion; returns its first choice."""
    return client.chat.completions.create(**LIMITS, **kwargs).choices[0]


def parse_model():
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    msg = parse(messages=MESSAGES, response_format=Sum, **LIMITS).choices[0].message
    need(isinstance(msg.parsed, Sum), f"message.parsed is {msg.parsed!r}, content {msg.content!r}")
    return msg.parsed


def json_object():
    choice = create(messages=MESSAGES, response_format={"type": "json_object"})
    try:
        value = json.loads(choice.message.content)
    except ValueError as e:
        raise RuntimeError(f"{e}; finish_reason={choice.finish_reason}, content={choice.message.content!r}")
    need(isinstance(value, dict), f"not an object: {value!r}")
    return value


def constrained(extra, accept):
    """A vLLM extension sent through extra_body; `accept` judges the content."""
    def go():
        choice = create(messages=MESSAGES, extra_body=extra)
        need(accept(choice.message.content), f"finish_reason={choice.finish_reason}, "
                                             f"content={choice.message.content!r}")
        return choice.message.content
    return go


def validates(content):
    try:
        return isinstance(Sum.model_validate_json(content), Sum)
    except ValueError:
        return False


def parsed_tool_call(**kwargs):
    """`parse` with a strict pydantic tool: the call's arguments come back as an Add."""
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    msg = parse(messages=TOOL_MESSAGES, tools=[openai.pydantic_function_tool(Add)], **kwargs, **LIMITS)
    msg = msg.choices[0].message
    need(msg.tool_calls, f"no tool_calls; content {msg.content!r}")
    args = msg.tool_calls[0].function.parsed_arguments
    need(isinstance(args, Add), f"parsed_arguments is {args!r}")
    return args


def named_tool_call():
    choice = create(messages=TOOL_MESSAGES, tools=[ADD], tool_choice={"type": "function",
                                                                      "function": {"name": "add"}})
    calls = choice.message.tool_calls
    need(calls and calls[0].function.name == "add", f"tool_calls={calls!r}, finish_reason={choice.finish_reason}")
    args = json.loads(calls[0].function.arguments)
    need(isinstance(args.get("a"), int) and isinstance(args.get("b"), int), f"arguments {args!r}")
    return args


def auto_tool_choice():
    msg = create(messages=TOOL_MESSAGES, tools=[ADD], tool_choice="auto").message
    need(msg.content or msg.tool_calls, "neither content nor tool_calls")
    return msg.tool_calls or msg.content


def no_tool_choice():
    msg = create(messages=TOOL_MESSAGES, tools=[ADD], tool_choice="none").message
    need(not msg.tool_calls and msg.content, f"tool_calls={msg.tool_calls!r}, content={msg.content!r}")
    return msg.content


def streamed_tool_call():
    """The SDK's stream helper assembles the tool-call deltas and parses the arguments."""
    stream = getattr(client.chat.completions, "stream", None) or client.beta.chat.completions.stream
    with stream(messages=TOOL_MESSAGES, tools=[openai.pydantic_function_tool(Add)],
                tool_choice={"type": "function", "function": {"name": "Add"}}, **LIMITS) as events:
        deltas = sum(e.type == "tool_calls.function.arguments.delta" for e in events)
        final = events.get_final_completion()
    calls = final.choices[0].message.tool_calls
    need(calls and isinstance(calls[0].function.parsed_arguments, Add), f"tool_calls={calls!r}")
    return {"argument_deltas": deltas, "arguments": calls[0].function.parsed_arguments}


def tool_result_turn():
    msg = create(messages=TOOL_MESSAGES + CALLED, tools=[ADD], tool_choice="none").message
    need(msg.content, f"no answer after the tool result: {msg!r}")
    return msg.content


def responses_text():
    response = client.responses.create(model=MODEL, input="Name a color.", max_output_tokens=16)
    need(response.output_text, f"no output_text: {response!r}")
    return response.output_text


def responses_parse():
    response = client.responses.parse(model=MODEL, input=ASK, text_format=Sum, max_output_tokens=128)
    need(isinstance(response.output_parsed, Sum), f"output_parsed is {response.output_parsed!r}")
    return response.output_parsed


check("chat.completions.parse(response_format=Sum)", "response_format json_schema (strict) from a pydantic "
      "model; message.parsed must be a Sum", parse_model)
check("response_format json_object", "response_format={'type': 'json_object'}; content must json.loads to an "
      "object", json_object)
check("structured_outputs choice", "extra_body structured_outputs={'choice': ['red', 'green', 'blue']}",
      constrained({"structured_outputs": {"choice": ["red", "green", "blue"]}},
                  lambda c: c in ("red", "green", "blue")))
check("structured_outputs json", "extra_body structured_outputs={'json': <Sum's JSON schema>}; content must "
      "validate as a Sum", constrained({"structured_outputs": {"json": Sum.model_json_schema()}}, validates))
check("guided_json", "extra_body guided_json=<Sum's JSON schema>; content must validate as a Sum",
      constrained({"guided_json": Sum.model_json_schema()}, validates))
check("guided_regex", "extra_body guided_regex='[0-9]{1,3}'",
      constrained({"guided_regex": "[0-9]{1,3}"}, lambda c: bool(re.fullmatch("[0-9]{1,3}", c or ""))))
check("tools parse, tool_choice=required", "tools=[pydantic_function_tool(Add)] (strict), tool_choice="
      "'required'; tool_calls[0].function.parsed_arguments must be an Add",
      lambda: parsed_tool_call(tool_choice="required"))
check("tools, tool_choice named", "tools=[add] (not strict), tool_choice={'type': 'function', 'function': "
      "{'name': 'add'}}; arguments must be JSON with integer a and b", named_tool_call)
check("tools, tool_choice=auto", "tools=[add], tool_choice='auto'; content or tool_calls", auto_tool_choice)
check("tools, tool_choice=none", "tools=[add], tool_choice='none'; content and no tool_calls", no_tool_choice)
check("chat.completions.stream tool call", "stream=True, tools=[pydantic_function_tool(Add)], tool_choice named "
      "'Add'; the SDK's stream helper must assemble and parse the call", streamed_tool_call)
check("role: tool turn", "messages: user, assistant with tool_calls, tool result; tools=[add], tool_choice="
      "'none'; an answer must come back", tool_result_turn)
check("responses.create", "POST /v1/responses input='Name a color.'", responses_text)
check("responses.parse(text_format=Sum)", "POST /v1/responses text.format json_schema from a pydantic model",
      responses_parse)
report(["openai", "pydantic", "httpx"])
