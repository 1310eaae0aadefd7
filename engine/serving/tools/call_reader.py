"""One tool call's JSON object read a character at a time, `{"name": <string>, <arguments
key>: <object>}` with the keys in either order, telling its scanner (scanners.py) the moment
it becomes a call and the arguments' text as the model writes it.

A call is committed once its name is known and its arguments have begun (their `{`). Before
that, whatever cannot become a call is refused, and the scanner gives the text back as
content. After it, the call's name and arguments so far have been streamed and cannot be
taken back: the call stands, and ends where the model stops writing valid JSON, its
arguments as far as they went (as OpenAI's do when max_tokens cuts a call short). The
arguments are the model's own text of the object, so what streams is what the whole
response carries, byte for byte."""

from __future__ import annotations

import json

from .json_prefix import JSON_WHITESPACE, JsonObjectScanner


class CallReader:
    def __init__(self, arguments_keys: tuple[str, ...]):
        self._json = JsonObjectScanner()
        self._keys = arguments_keys
        self._chars: list[str] = []
        self.name: str | None = None
        self.committed = False
        self._key_chars: list[str] | None = None   # a key of the outer object being read
        self._key: str | None = None               # the outer object's key whose value comes next
        self._seen: set[str] = set()
        self._name_chars: list[str] | None = None  # the name's string being read
        self._args_start: int | None = None        # where the arguments' `{` is in the text
        self._args_end: int | None = None
        self._taken = 0                            # argument characters handed out

    @property
    def text(self) -> str:
        """Every character taken so far (a refused one is not)."""
        return "".join(self._chars)

    @property
    def complete(self) -> bool:
        """The outer object has closed."""
        return self._json.complete

    def feed(self, c: str) -> bool:
        """Takes one character; False when it cannot continue: before the commitment, the
        text cannot be a call; after it, the JSON is broken (the call ends before `c`)."""
        before_depth, before_string, value_next = self._json.depth, self._json.string, self._json.expects_value
        if not self._json.feed(c):
            return False
        self._chars.append(c)
        at = len(self._chars) - 1
        if self._args_start is not None and self._args_end is None and before_depth == 2 and self._json.depth == 1:
            self._args_end = at + 1
        if self.committed:
            return True
        if before_depth == 1 and not self._outer(c, at, before_string, value_next):
            self._chars.pop()
            return False
        if self.name is not None and self._args_start is not None:
            self.committed = True
        if self._json.complete and not self.committed:  # a whole object that is no call
            self._chars.pop()
            return False
        return True

    def _outer(self, c: str, at: int, before_string: str | None, value_next: bool) -> bool:
        """Follows the outer object's keys and values (a character read at depth 1)."""
        if before_string == "key" or self._json.string == "key":
            self._key_chars = (self._key_chars or []) + [c] if before_string == "key" else [c]
            if self._json.string is None:  # the key's closing quote
                key = json.loads("".join(self._key_chars))
                if key in self._seen or (key != "name" and key not in self._keys) or (
                        key in self._keys and self._seen & set(self._keys)):
                    return False
                self._seen.add(key)
                self._key = key
            return True
        if before_string == "value":  # the name's string
            self._name_chars.append(c)
            if self._json.string is None:
                self.name = json.loads("".join(self._name_chars))
            return True
        if value_next and c not in JSON_WHITESPACE:
            if self._key == "name":
                self._name_chars = [c]
                return c == '"'
            self._args_start = at
            return c == "{"
        return True

    def take_arguments(self) -> str:
        """The arguments' text written since the last call (once committed)."""
        if not self.committed:
            return ""
        end = self._args_end if self._args_end is not None else len(self._chars)
        start = self._args_start + self._taken
        self._taken = end - self._args_start
        return "".join(self._chars[start:end])
