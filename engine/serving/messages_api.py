"""Anthropic's Messages API (POST /v1/messages) on top of chat completions, so that clients
and coding agents written against it run on the served model.

A request is translated into a chat request: `system` -> a system message; user text and
`tool_result` blocks -> user and tool messages; assistant text and `tool_use` blocks -> an
assistant message with its tool calls; `tools` (name, description, input_schema) ->
function tools; `tool_choice` auto | any | tool | none -> auto | required | the named
function | none; `stop_sequences` -> stop; `max_tokens` (required) -> max_completion_tokens;
with a reasoning parser, `thinking` enabled -> its budget_tokens as thinking_token_budget,
disabled -> the template's enable_thinking false. The chat reply is reshaped: `thinking`
(its reasoning), text and `tool_use` blocks, `stop_reason` end_turn | max_tokens |
stop_sequence | tool_use, and usage in input and output tokens. Streamed, the chat chunks
become Anthropic's events (message_start, content_block_start, thinking_delta, text_delta
and input_json_delta content_block_deltas as the model writes, content_block_stop,
message_delta, message_stop). Errors come in Anthropic's shape, `{"type": "error", "error":
{"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from meshserve.engine.serving.openai_generation import EventStream, Generation, StreamError, chunks, whole
from meshserve.engine.serving.openai_protocol import IGNORED_HEADER, ChatCompletionRequest, OpenAIError, _Strict
from meshserve.engine.serving.request_body import parse_body, validation_error

StartChat = Callable[[ChatCompletionRequest, Request], Awaitable[Generation]]
CHAT_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "thinking_token_budget": "thinking"}
"""The chat parameters whose errors a Messages client knows by another name."""
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn", "abort": "end_turn"}
HONOURED = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
            "tools", "tool_choice", "metadata"}
"""Fields honoured whatever the server; `thinking` too where it splits reasoning."""


class MessagesRequest(_Strict):
    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    """{"type": "enabled", "budget_tokens": N} | {"type": "disabled"}."""

    def ignored(self, reasoning: bool) -> list[str]:
        """The fields given that are not honoured (`reasoning`: whether replies' reasoning is
        split off, without which `thinking` is not)."""
        given = set(self.model_extra or {}) | ({"thinking"} if self.thinking is not None and not reasoning else set())
        return sorted(given - HONOURED)


def anthropic_error(err: OpenAIError) -> JSONResponse:
    kind = ERROR_TYPES.get(err.status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": err.message}}, err.status)


def _bad(message: str, param: str = "messages") -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def _text(content: Any, where: str) -> str:
    """A content (a string or text blocks) as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise _bad(f"{where}: only text content is served here")


def _messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, message in enumerate(req.messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise _bad(f"messages[{i}].role must be user or assistant, got {str(role)[:40]!r}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _bad(f"messages[{i}].content must be a string or a list of content blocks")
        texts, calls = [], []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id")), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id")),
                            "content": _text(result, where)})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise _bad(f"{where}.type={str(kind)[:40]!r} is not served in a {role} message (text, tool_use, "
                           f"tool_result)")
        if role == "assistant":
            out.append({"role": "assistant", "content": "".join(texts) or None} | ({"tool_calls": calls} if calls else {}))
        elif texts or not blocks:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _tools(req: MessagesRequest) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    out = []
    for i, tool in enumerate(req.tools):
        if tool.get("type") not in (None, "custom") or "name" not in tool:
            raise _bad(f"tools[{i}]: only custom tools (name, description, input_schema) are served", "tools")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """chat's tool_choice and parallel_tool_calls."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
    raise _bad(f"tool_choice.type={str(kind)[:40]!r} must be auto, any, tool or none", "tool_choice")


def _thinking(thinking: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of a `thinking` setting."""
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise _bad(f"thinking.budget_tokens must be a positive integer, got {str(budget)[:40]}", "thinking")
        return {"thinking_token_budget": budget}
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    raise _bad(f"thinking.type={str(kind)[:40]!r} must be enabled or disabled", "thinking")


def to_chat(req: MessagesRequest, reasoning: bool = False) -> ChatCompletionRequest:
    """The chat request that generates the reply; `thinking` applied where `reasoning`
    (the server splits replies' reasoning off)."""
    choice, parallel = _tool_choice(req.tool_choice)
    body: dict[str, Any] = {"messages": _messages(req), "stream": req.stream, "max_completion_tokens": req.max_tokens}
    if reasoning and req.thinking is not None:
        body |= _thinking(req.thinking)
    for name, value in (("model", req.model), ("temperature", req.temperature), ("top_p", req.top_p),
                        ("top_k", req.top_k), ("stop", req.stop_sequences), ("tools", _tools(req)),
                        ("tool_choice", choice), ("parallel_tool_calls", parallel)):
        if value is not None:
            body[name] = value
    try:
        return ChatCompletionRequest.model_validate_json(msgspec.json.encode(body))
    except ValidationError as e:
        raise validation_error(e) from None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:  # a call the model broke off (max_tokens): its input as far as it parses, none
        arguments = {}
    return {"type": "tool_use", "id": _use_id(call["id"]), "name": call["function"]["name"], "input": arguments}


def _use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _stop(choice: dict[str, Any], stops: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice."""
    matched = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and isinstance(matched, str) and matched in (stops or []):
        return "stop_sequence", matched
    return STOP_REASONS.get(choice.get("finish_reason"), "end_turn"), None


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    chat_usage = chat_usage or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessagesApi:
    """POST /v1/messages, generated by the chat pipeline (`start_chat`)."""

    def __init__(self, start_chat: StartChat, model_name: str, max_model_len: int, reasoning: bool = False):
        """`reasoning`: whether the server splits replies' reasoning off (a reasoning parser)."""
        self.start_chat, self.model_name, self.max_model_len = start_chat, model_name, max_model_len
        self.reasoning = reasoning

    async def create(self, raw: Request):
        try:
            req = parse_body(await raw.body(), MessagesRequest, self.max_model_len)
            gen = await self.start_chat(to_chat(req, self.reasoning), raw)
        except OpenAIError as e:
            return anthropic_error(e.renamed(CHAT_NAMES))
        ignored = req.ignored(self.reasoning)
        headers = {IGNORED_HEADER: ", ".join(ignored)} if ignored else {}
        message_id = "msg_" + uuid.uuid4().hex
        if not req.stream:
            return JSONResponse(self._whole(req, message_id, whole(gen)), headers=headers)
        stream = MessageStream(req, message_id, self.model_name if req.model is None else req.model,
                               len(gen.prompt_ids[0]))
        return EventStream(stream.events(chunks(gen, "final")), gen.run.close, headers)

    def _whole(self, req: MessagesRequest, message_id: str, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        thought = message.get("reasoning_content")
        content = [{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []
        content += [{"type": "text", "text": message["content"]}] if message.get("content") else []
        content += [_tool_use(c) for c in message.get("tool_calls") or []]
        reason, sequence = _stop(choice, req.stop_sequences)
        return {"id": message_id, "type": "message", "role": "assistant", "model": req.model or self.model_name,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": _usage(chat.get("usage"))}


class MessageStream:
    """A streamed reply's events, from the chat chunks."""

    def __init__(self, req: MessagesRequest, message_id: str, model: str, prompt_tokens: int):
        self.req, self.id, self.model, self.prompt_tokens = req, message_id, model, prompt_tokens
        self.block: int = -1
        """The index of the content block open now (-1: none yet)."""
        self.kind: str | None = None
        self.calls: dict[int, int] = {}
        """Chat's tool-call index -> its block's index."""
        self.finish: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None

    @staticmethod
    def sse(events: list[dict[str, Any]]) -> bytes:
        return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + msgspec.json.encode(e) + b"\n\n"
                        for e in events)

    async def events(self, batches):
        start = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                 "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        yield self.sse([{"type": "message_start", "message": start}])
        try:
            async for batch in batches:
                out = [e for chunk in batch for e in self.on_chunk(chunk)]
                if out:
                    yield self.sse(out)
        except StreamError as e:
            kind = ERROR_TYPES.get(e.error.status, "api_error")
            yield self.sse([{"type": "error", "error": {"type": kind, "message": e.error.message}}])
            return
        yield self.sse(self.closing())

    def on_chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = _usage(chunk["usage"])
            return []
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                events.append({"type": "content_block_delta", "index": self.block,
                               "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}})
            if delta.get("content"):
                events += self._open("text", {"type": "text", "text": ""})
                events.append({"type": "content_block_delta", "index": self.block,
                               "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                if call.get("id") is not None:
                    events += self._open("tool_use", {"type": "tool_use", "id": _use_id(call["id"]),
                                                      "name": call["function"]["name"], "input": {}}, new=True)
                    self.calls[call["index"]] = self.block
                arguments = (call.get("function") or {}).get("arguments")
                if arguments:
                    events.append({"type": "content_block_delta", "index": self.calls[call["index"]],
                                   "delta": {"type": "input_json_delta", "partial_json": arguments}})
            if choice.get("finish_reason"):
                self.finish = choice
        return events

    def _open(self, kind: str, block: dict[str, Any], new: bool = False) -> list[dict[str, Any]]:
        """Events that make a block of `kind` the open one (a tool call's is always new)."""
        if self.kind == kind and not new:
            return []
        events = self._close()
        self.block, self.kind = self.block + 1, kind
        return events + [{"type": "content_block_start", "index": self.block, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.block}]

    def closing(self) -> list[dict[str, Any]]:
        reason, sequence = _stop(self.finish, self.req.stop_sequences)
        usage = self.usage or _usage(None)
        return self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": {"output_tokens": usage["output_tokens"]}},
            {"type": "message_stop"}]
