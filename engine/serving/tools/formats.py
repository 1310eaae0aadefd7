"""Tool-call formats: how one family of models writes a call, reads the calls back, is told
about the tools when its chat template cannot say it, and is forced to write one call.

    fmt = tool_format_for(tokenizer.chat_template)   # HERMES or LLAMA3_JSON
    fmt.parse(text)                                  # ParsedMessage(content, tool_calls)
    stream = fmt.stream(); stream.feed(delta) ...; stream.finish()
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any

from .message_shapes import ParsedMessage, ToolCallStream, parsed_message
from .scanners import HERMES_CLOSE, HERMES_OPEN, PYTHON_TAG, HermesScanner, Llama3JsonScanner

_HERMES_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
"""Qwen2.5's chat template words (Hermes 2 Pro's, shortened), which such models were tuned on."""

_LLAMA3_INSTRUCTIONS = (
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n"
    'Respond in the format {{"name": function name, "parameters": dictionary of argument name and its '
    'value}}. Do not use variables.\n\n{tools}')
"""Llama 3.1's chat template words for custom tools."""


class ToolFormat(ABC):
    """One tool-call syntax. Stateless: `stream()` makes the per-choice state."""

    name: str
    arguments_key: str
    """The key under which a call's arguments go when this format writes one."""
    forced_prefix: str
    forced_suffix: str
    """Around the JSON of a forced call (see constraints.forced_call)."""
    call_open: str | None
    """The text that opens a call, which also ends a reasoning block the model left open
    (engine/serving/reasoning.py); None where a call has no opening text of its own."""

    def parse(self, text: str) -> ParsedMessage:
        """The content and tool calls of a whole output. Never raises: text that is not a
        well-formed call (bad JSON, a wrong key, a missing marker) stays content."""
        scanner = self._scanner()
        return parsed_message(scanner.feed(text) + scanner.finish())

    def stream(self) -> ToolCallStream:
        """A streaming parser for one choice (see ToolCallStream)."""
        return ToolCallStream(self._scanner())

    def call_schema(self, name: str, arguments_schema: dict[str, Any]) -> dict[str, Any]:
        """JSON schema of the object this format writes for a call of `name`."""
        return {"type": "object",
                "properties": {"name": {"const": name}, self.arguments_key: arguments_schema},
                "required": ["name", self.arguments_key], "additionalProperties": False}

    def call_json(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)

    @abstractmethod
    def _scanner(self) -> Any:
        """A fresh scanner (scanners.py) for one output."""

    @abstractmethod
    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """The system-prompt text that describes `tools` and this syntax, for chat templates
        that do not render tools themselves."""

    @abstractmethod
    def render_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """An earlier assistant turn's calls as this format writes them, (name, arguments)
        each; `parse()` reads the text back as the same calls."""


class HermesFormat(ToolFormat):
    """Hermes 2 Pro / Qwen2.5: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    as many as the model wants, with text around them."""

    name = "hermes"
    arguments_key = "arguments"
    forced_prefix = HERMES_OPEN + "\n"
    forced_suffix = "\n" + HERMES_CLOSE
    call_open = HERMES_OPEN

    def _scanner(self) -> HermesScanner:
        return HermesScanner()

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        return _HERMES_INSTRUCTIONS.format(tools=listed)

    def render_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(self.forced_prefix + self.call_json(n, a) + self.forced_suffix for n, a in calls)


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1-3.3 JSON calls: `{"name": ..., "parameters": {...}}`, the whole output or
    after `<|python_tag|>`, several separated by `;`.

    NOTE: `<|python_tag|>` is a special token, so with skip_special_tokens it never reaches
    the text; calls at the start of the output are found without it."""

    name = "llama3_json"
    arguments_key = "parameters"
    forced_prefix = ""
    forced_suffix = ""
    call_open = None

    def _scanner(self) -> Llama3JsonScanner:
        return Llama3JsonScanner()

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return _LLAMA3_INSTRUCTIONS.format(tools=listed)

    def render_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "; ".join(self.call_json(n, a) for n, a in calls)


HERMES = HermesFormat()
LLAMA3_JSON = Llama3JsonFormat()
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON)}


def tool_format_for(chat_template: str | None) -> ToolFormat:
    """The format a model writes, from its chat template's source: one that mentions
    `<tool_call>` is Hermes; `<|python_tag|>` or an `ipython` role is Llama 3 JSON.

    NOTE: anything else gets Hermes, with its instructions in the system prompt (render.py):
    it is the format most open models are tuned on, and its markers keep calls apart from
    prose, where a bare JSON object could be a model's answer."""
    source = chat_template or ""
    if HERMES_OPEN in source:
        return HERMES
    if PYTHON_TAG in source or re.search(r"\bipython\b", source):
        return LLAMA3_JSON
    return HERMES
