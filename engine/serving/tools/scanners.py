"""The two tool-call syntaxes, read incrementally: a scanner takes the model's text in any
pieces and gives back, in order, plain text (str) and complete tool calls (FoundCall).

`parse()` and the streaming parser both run a scanner, one over the whole text and one
over the deltas, so they agree by construction as long as a scanner's decisions depend only
on the characters, never on where the deltas split them (tests/unit/test_tool_calls.py checks
this over random splits).

NOTE: a tool call is held back until its JSON and closing marker are complete, and only then
released. Streaming its arguments as they arrive would be faster, but a sent fragment cannot be
taken back, and until the call closes the model can still make it malformed (a bad character,
a missing marker, the output cut off by max_tokens), which must leave the text as content, the
same as parse() on the whole output. Plain text is released as soon as it cannot be the start
of a marker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .json_prefix import JsonObjectScanner, decode_object

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class FoundCall:
    name: str
    arguments: dict[str, Any]


Segment = str | FoundCall


def call_from_json(value: Any, arguments_keys: tuple[str, ...]) -> FoundCall | None:
    """A call from a decoded object with exactly a string "name" and an object under one of
    `arguments_keys`; None for anything else (left as content by the scanners)."""
    if not isinstance(value, dict) or len(value) != 2 or not isinstance(value.get("name"), str):
        return None
    args = [value[k] for k in arguments_keys if k in value]
    if len(args) != 1 or not isinstance(args[0], dict):
        return None
    return FoundCall(value["name"], args[0])


def marker_overlap(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`: the text
    to hold back because the next delta may complete the marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _MarkerSearch:
    """Plain text up to a marker, holding back a possible partial marker at the end."""

    def __init__(self, marker: str):
        self.marker = marker
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """(plain text before the marker, the text after it) if the marker is complete, else
        (releasable plain text, None)."""
        text = self.held + text
        at = text.find(self.marker)
        if at >= 0:
            self.held = ""
            return text[:at], text[at + len(self.marker):]
        keep = marker_overlap(text, self.marker)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], None


class _JsonCall:
    """One tool call's JSON object, fed a character at a time."""

    def __init__(self, arguments_keys: tuple[str, ...]):
        self.keys = arguments_keys
        self.scanner = JsonObjectScanner()
        self._chars: list[str] = []

    @property
    def text(self) -> str:
        """Every character fed, the refused one included."""
        return "".join(self._chars)

    def feed(self, c: str) -> FoundCall | bool:
        """The call once the object closes; True while it may still become one; False once
        it cannot."""
        self._chars.append(c)
        if not self.scanner.feed(c):
            return False
        if not self.scanner.complete:
            return True
        return call_from_json(decode_object(self.text), self.keys) or False


class HermesScanner:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the text, with
    whitespace inside the markers. A malformed call gives its `<tool_call>` back as text and
    scanning resumes right after it. At the end of the output a complete JSON object whose
    closing marker never came still counts (the model stopped right after it)."""

    def __init__(self, arguments_keys: tuple[str, ...] = ("arguments", "parameters")):
        self._keys = arguments_keys
        self._search = _MarkerSearch(HERMES_OPEN)
        self._body: str | None = None    # text after <tool_call>, None outside a call
        self._call: _JsonCall | FoundCall | None = None
        self._close = ""                 # the part of </tool_call> seen after the object

    def feed(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        while text:
            if self._body is None:
                plain, text = self._search.feed(text)
                out += [plain] if plain else []
                if text is None:
                    break
                self._body, self._call, self._close = "", None, ""
            else:
                text = self._feed_call(text, out)
        return out

    def finish(self) -> list[Segment]:
        out: list[Segment] = []
        while self._body is not None:
            if isinstance(self._call, FoundCall) and not self._close:
                out.append(self._call)
                self._body = None
            else:
                body = self._give_back(out)
                out += self.feed(body)
        held, self._search.held = self._search.held, ""
        return out + ([held] if held else [])

    def _feed_call(self, text: str, out: list[Segment]) -> str:
        """Feeds `text` into the open call until it closes or fails; returns the text still
        to scan."""
        for i, c in enumerate(text):
            state = self._step(c)
            if state is True:
                continue
            self._body += text[:i + 1]
            if state is False:
                return self._give_back(out) + text[i + 1:]
            out.append(state)
            self._body = None
            return text[i + 1:]
        self._body += text
        return ""

    def _step(self, c: str) -> FoundCall | bool:
        """Advances the open call by one character (see _JsonCall.feed for the result)."""
        if self._call is None:
            if c.isspace():
                return True
            if c != "{":
                return False
            self._call = _JsonCall(self._keys)
        if isinstance(self._call, _JsonCall):
            state = self._call.feed(c)
            if isinstance(state, FoundCall):
                self._call = state
                return True
            return state
        if not self._close and c.isspace():
            return True
        self._close += c
        if not HERMES_CLOSE.startswith(self._close):
            return False
        return self._call if self._close == HERMES_CLOSE else True

    def _give_back(self, out: list[Segment]) -> str:
        """A malformed call: its marker becomes text, and the text that followed the marker
        is returned to be scanned again."""
        body, self._body = self._body, None
        out.append(HERMES_OPEN)
        return body


class Llama3JsonScanner:
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}` at the start of the output
    or after `<|python_tag|>`, several separated by `;`. A call that fails gives its text back
    to be scanned as text (its `<|python_tag|>` included); text after a call ends the run of
    calls, and a later `<|python_tag|>` starts another."""

    def __init__(self, arguments_keys: tuple[str, ...] = ("parameters", "arguments")):
        self._keys = arguments_keys
        self._search = _MarkerSearch(PYTHON_TAG)
        self._state = "start"      # start | text | calls | call | after_call
        self._held = ""            # the tag or `;` and whitespace before the next call
        self._call: _JsonCall | None = None

    def feed(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        while text:
            if self._state != "text":
                text = self._feed_chars(text, out)
                continue
            plain, text = self._search.feed(text)
            out += [plain] if plain else []
            if text is not None:
                self._state, self._held = "calls", PYTHON_TAG
        return out

    def finish(self) -> list[Segment]:
        out: list[Segment] = []
        while self._state == "call" or (self._state == "calls" and self._held.startswith(PYTHON_TAG)):
            unfinished = self._call.text if self._state == "call" else ""  # or a tag with no call after it
            again = self._give_back(out, unfinished)
            out += self.feed(again)
        held, self._search.held = self._search.held, ""
        self._state, self._held = "text", ""  # a trailing `;` or whitespace is dropped
        return out + ([held] if held else [])

    def _feed_chars(self, text: str, out: list[Segment]) -> str:
        """Steps the start/calls/call/after_call states a character at a time; returns the
        text left to scan once the state turns to text."""
        for i, c in enumerate(text):
            again = self._step(c, out)
            if again is not None:
                return again + text[i + 1:]
        return ""

    def _step(self, c: str, out: list[Segment]) -> str | None:
        """Advances one character; the text to scan again (`c` included) once the state
        has turned to text, else None."""
        state = self._state
        if state == "start" and c.isspace():
            out.append(c)
            return None
        if state in ("start", "calls") and c != "{":
            if c.isspace():
                self._held += c
                return None
            return self._give_back(out, c)
        if state in ("start", "calls"):
            self._call, self._state = _JsonCall(self._keys), "call"
        if self._state == "call":
            found = self._call.feed(c)
            if found is False:
                return self._give_back(out, self._call.text)
            if isinstance(found, FoundCall):
                out.append(found)
                self._state, self._held, self._call = "after_call", "", None
            return None
        if c.isspace() or c == ";":  # after_call
            self._state = "calls" if c == ";" else state
            self._held += c
            return None
        out += [self._held] if self._held else []
        self._state, self._held = "text", ""
        return c

    def _give_back(self, out: list[Segment], text: str) -> str:
        """A call that cannot be one: the tag before it is text, and the separator and its
        own text are returned to be scanned again as text."""
        held, self._held, self._call, self._state = self._held, "", None, "text"
        if held.startswith(PYTHON_TAG):
            out.append(PYTHON_TAG)
            held = held[len(PYTHON_TAG):]
        return held + text
