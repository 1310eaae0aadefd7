"""A scanner's segments (plain text, tool calls) in OpenAI's shapes: a whole message
(`ParsedMessage`) or chat-chunk `delta` fragments as the text streams in (`ToolCallStream`).

NOTE: the content of a message with tool calls is trimmed of the whitespace at its ends
(Hermes models put newlines between and around `<tool_call>` blocks; a client would otherwise
get "\\n\\n" as content next to its calls). Content is the text outside the calls with
`str.strip()` applied, and None when that is empty and there are calls. The streaming side
gets the same result by holding back whitespace until text follows it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from .scanners import CallArguments, CallStart, Segment


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parsed_message(segments: list[Segment]) -> ParsedMessage:
    """The message of a whole output scanned in one go."""
    calls: list[dict[str, Any]] = []
    text = []
    for s in segments:
        if isinstance(s, CallStart):
            calls.append({"id": new_call_id(), "type": "function", "function": {"name": s.name, "arguments": ""}})
        elif isinstance(s, CallArguments):
            calls[-1]["function"]["arguments"] += s.text
        else:
            text.append(s)
    content = "".join(text).strip()
    return ParsedMessage(None if calls and not content else content, calls)


class _TrimmedText:
    """Text released as it streams in, such that all of it together equals the whole text
    with str.strip() applied: leading whitespace is dropped, and whitespace is held until
    non-whitespace follows it (at the end it is dropped)."""

    def __init__(self) -> None:
        self._started = False
        self._space = ""

    def push(self, text: str) -> str:
        pending = self._space + text
        kept = pending.rstrip()
        self._space = pending[len(kept):]
        if not self._started:
            kept = kept.lstrip()
            self._started = bool(kept)
        return kept


class ToolCallStream:
    """Chat-chunk `delta` fragments for one choice, fed the detokenized text as it comes.

    `feed(text_delta)` and `finish()` return lists of deltas: `{"content": str}` for text,
    and for the i-th tool call, once it is committed, `{"tool_calls": [{"index": i, "id",
    "type": "function", "function": {"name", "arguments": ""}}]}`, then `{"tool_calls":
    [{"index": i, "function": {"arguments": str}}]}` as its arguments are written (valid JSON
    once whole, as OpenAI's). Joining the contents and, per index, the arguments gives what
    `parse()` returns for the whole text."""

    def __init__(self, scanner: Any):
        self._scanner = scanner
        self._text = _TrimmedText()
        self.num_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self._deltas(self._scanner.feed(text)) if text else []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held back; call once, after the last `feed`."""
        return self._deltas(self._scanner.finish())

    def _deltas(self, segments: list[Segment]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for seg in segments:
            if isinstance(seg, CallStart):
                index, self.num_calls = self.num_calls, self.num_calls + 1
                out.append({"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                            "function": {"name": seg.name, "arguments": ""}}]})
                continue
            if isinstance(seg, CallArguments):
                out.append({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": seg.text}}]})
                continue
            text = self._text.push(seg)
            if text and out and "content" in out[-1]:
                out[-1]["content"] += text
            elif text:
                out.append({"content": text})
        return out
