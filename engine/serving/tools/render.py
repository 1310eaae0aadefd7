"""The conversation (OpenAI chat messages, tools) as the chat template gets it.

A template that renders tools itself (Qwen2.5, Llama 3.1, Hermes 2 Pro, ...) gets `tools=`
and the messages in the shape Hugging Face templates expect: assistant `tool_calls` with
arguments as dicts, `tool` messages with `tool_call_id`. A template that knows nothing of
tools (SmolLM2's ChatML) gets plain role/content messages: the tool instructions go into the
system message, an assistant's calls become its text in the model's format, and tool results
become a user message of `<tool_response>` blocks, as Qwen2.5's template writes them.
Every content handed to a template is a string.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .formats import ToolFormat
from .validation import ToolRequestError

Message = dict[str, Any]


def chat_template_source(template: str | dict[str, str] | None) -> str | None:
    """A tokenizer's chat template as text: of named templates (Hugging Face's dict), the
    "tool_use" one, which transformers picks when tools are given, else the "default"."""
    if isinstance(template, dict):
        return template.get("tool_use") or template.get("default")
    return template


def template_uses_tools(template_source: str | None) -> bool:
    """Whether a chat template renders tools itself (its source reads a `tools` variable)."""
    return template_source is not None and re.search(r"\btools\b", template_source) is not None


def render_messages(messages: list[Message], tools: list[dict[str, Any]] | None, template_source: str | None,
                    fmt: ToolFormat) -> tuple[list[Message], dict[str, Any]]:
    """(messages for the template, extra keyword arguments for apply_chat_template).
    Raises ToolRequestError("messages") for an assistant tool call whose arguments are not
    a JSON object."""
    if template_uses_tools(template_source):
        return native_messages(messages), ({"tools": tools} if tools else {})
    return fallback_messages(messages, tools, fmt), {}


def native_messages(messages: list[Message]) -> list[Message]:
    """The messages in Hugging Face's tool-use shape. A tool message without a `name` gets
    the name of the call it answers (templates such as Hermes 2 Pro's print it)."""
    out, names = [], {}
    for i, m in enumerate(messages):
        msg = {"role": _role(m), "content": content_text(m.get("content"), i)}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        if msg["role"] == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = []
            for j, call in enumerate(m["tool_calls"]):
                name, arguments = call_parts(call, f"messages[{i}].tool_calls[{j}]")
                msg["tool_calls"].append({"id": call.get("id"), "type": "function",
                                          "function": {"name": name, "arguments": arguments}})
                names[call.get("id")] = name
        if msg["role"] == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
            if "name" not in msg and msg["tool_call_id"] in names:
                msg["name"] = names[msg["tool_call_id"]]
        out.append(msg)
    return out


def fallback_messages(messages: list[Message], tools: list[dict[str, Any]] | None, fmt: ToolFormat) -> list[Message]:
    """Plain role/content messages that carry the tools, calls and results as text."""
    out: list[Message] = []
    for i, m in enumerate(messages):
        role, text = _role(m), content_text(m.get("content"), i)
        if role == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            if i > 0 and _role(messages[i - 1]) == "tool":  # one user turn for a run of results
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = [call_parts(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
            text = (text + "\n" if text else "") + fmt.render_calls(calls)
        out.append({"role": role, "content": text})
    if tools:
        _add_to_system(out, fmt.instructions(tools))
    return out


def _add_to_system(messages: list[Message], text: str) -> None:
    """Appends `text` to the leading system message, or puts one first."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        messages[0]["content"] = f"{first}\n\n{text}" if first else text
    else:
        messages.insert(0, {"role": "system", "content": text})


def _role(message: Message) -> str:
    return "system" if message.get("role") == "developer" else message.get("role")


def content_text(content: Any, index: int) -> str:
    """A message content as one string: None is "", text parts are joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ToolRequestError("messages", f"messages[{index}].content must be a string or a list of text parts")


def call_parts(call: Any, where: str) -> tuple[str, dict[str, Any]]:
    """(name, arguments as a dict) of an OpenAI tool call in a request's messages."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ToolRequestError("messages", f'{where} must be {{"type": "function", '
                                           f'"function": {{"name", "arguments"}}}}')
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ToolRequestError("messages", f"{where}.function.arguments is not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ToolRequestError("messages", f"{where}.function.arguments must be a JSON object, "
                                           f"got {type(arguments).__name__}")
    return function["name"], arguments
