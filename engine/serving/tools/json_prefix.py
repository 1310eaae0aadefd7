"""An incremental check that a text is still the beginning of one JSON object, fed a
character at a time, so a tool-call parser knows as soon as the model's JSON turns
malformed (instead of holding text until the end of the output) and knows where the
object ends without parsing it again on every delta.

The grammar is what `decode_object` accepts: RFC 8259 JSON as Python's `json` reads it
strictly (no NaN or Infinity, no raw control characters inside strings).
"""

from __future__ import annotations

import json
import re
from typing import Any

JSON_WHITESPACE = " \t\n\r"

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9]\d*)(?:\.(?:\d+(?:[eE][-+]?\d*)?)?|[eE][-+]?\d*)?)?")
_LITERALS = ("true", "false", "null")
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def decode_object(text: str) -> Any:
    """The value of a JSON text that `JsonObjectScanner` found complete."""
    return _DECODER.decode(text)


class JsonObjectScanner:
    """Follows one JSON object character by character. `feed(c)` returns False at the first
    character that no valid object could contain at that place; `complete` turns True on
    the closing brace of the outer object (the scanner takes no characters after it)."""

    def __init__(self) -> None:
        self.complete = False
        self._stack: list[str] = []      # "{" or "[" of each open container
        self._expect = "object"          # what the next structural character may be
        self._string: str | None = None  # None outside a string; else "key" or "value"
        self._escape = 0                 # 0: none; 1: after a backslash; 2..5: \\u digits left + 1
        self._token = ""                 # the number or literal being read

    @property
    def depth(self) -> int:
        """How many objects and arrays are open."""
        return len(self._stack)

    @property
    def string(self) -> str | None:
        """"key" or "value" inside a string (its quotes included), else None."""
        return self._string

    @property
    def expects_value(self) -> bool:
        """Whether the next character other than whitespace starts a value."""
        return self._string is None and not self._token and self._expect in ("value", "value_or_close")

    def feed(self, c: str) -> bool:
        if self.complete:
            return False
        if self._string is not None:
            return self._in_string(c)
        if self._token:
            if self._token_takes(c):
                self._token += c
                return True
            if not self._end_token():
                return False
        return self._structural(c)

    def _in_string(self, c: str) -> bool:
        if self._escape == 1:
            self._escape = 5 if c == "u" else 0
            return c == "u" or c in _ESCAPES
        if self._escape:
            self._escape = self._escape - 1 if self._escape > 2 else 0
            return c in _HEX
        if c == "\\":
            self._escape = 1
        elif c == '"':
            kind, self._string = self._string, None
            self._expect = "colon" if kind == "key" else self._after_value()
        elif ord(c) < 0x20:
            return False
        return True

    def _token_takes(self, c: str) -> bool:
        if self._token[0] in "-0123456789":
            return _NUMBER_PREFIX.fullmatch(self._token + c) is not None
        return any(lit.startswith(self._token + c) for lit in _LITERALS)

    def _end_token(self) -> bool:
        """Closes the number or literal read so far; False when it is unfinished."""
        token, self._token = self._token, ""
        if token not in _LITERALS and _NUMBER.fullmatch(token) is None:
            return False
        self._expect = self._after_value()
        return True

    def _after_value(self) -> str:
        return "comma_or_close" if self._stack else "done"

    def _structural(self, c: str) -> bool:
        if c in JSON_WHITESPACE:
            return True
        expect = self._expect
        if expect == "object":
            return c == "{" and self._open(c)
        if expect in ("value", "value_or_close"):
            if expect == "value_or_close" and c == "]":
                return self._close(c)
            return self._start_value(c)
        if expect in ("key", "key_or_close"):
            if expect == "key_or_close" and c == "}":
                return self._close(c)
            if c == '"':
                self._string = "key"
                return True
            return False
        if expect == "colon":
            if c == ":":
                self._expect = "value"
            return c == ":"
        if expect == "comma_or_close":
            if c == ",":
                self._expect = "key" if self._stack[-1] == "{" else "value"
                return True
            return c in "]}" and self._close(c)
        return False

    def _start_value(self, c: str) -> bool:
        if c in "{[":
            return self._open(c)
        if c == '"':
            self._string = "value"
            return True
        if c in "-0123456789" or any(lit.startswith(c) for lit in _LITERALS):
            self._token = c
            return True
        return False

    def _open(self, c: str) -> bool:
        self._stack.append(c)
        self._expect = "key_or_close" if c == "{" else "value_or_close"
        return True

    def _close(self, c: str) -> bool:
        if (self._stack[-1], c) not in (("{", "}"), ("[", "]")):
            return False
        self._stack.pop()
        self._expect = self._after_value()
        self.complete = not self._stack
        return True
