"""The two tool-call syntaxes, read incrementally: a scanner takes the model's text in any
pieces and gives back, in order, plain text (str) and tool calls as they are written: a
call's start (CallStart, its name) once it is committed, then its arguments' text
(CallArguments) as it comes (call_reader.py says when a call commits and how a committed
call ends).

`parse()` and the streaming parser both run a scanner, one over the whole text and one
over the deltas, so they agree by construction as long as a scanner's decisions depend only
on the characters, never on where the deltas split them (tests/unit/test_tool_calls.py checks
this over random splits). Plain text is released as soon as it cannot be the start of a
marker or of a call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .call_reader import CallReader

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its name (its arguments follow)."""

    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of the current call's arguments' text."""

    text: str


Segment = str | CallStart | CallArguments


def _arguments(out: list[Segment], reader: CallReader) -> None:
    """Appends what the reader has of the current call's arguments, merged into the
    arguments just before it, if any."""
    text = reader.take_arguments()
    if not text:
        return
    if out and isinstance(out[-1], CallArguments):
        out[-1] = CallArguments(out[-1].text + text)
    else:
        out.append(CallArguments(text))


def _read(out: list[Segment], reader: CallReader, c: str) -> bool:
    """Feeds `c` to the call; appends its start when it commits and its arguments' text."""
    committed = reader.committed
    if not reader.feed(c):
        return False
    if reader.committed and not committed:
        out.append(CallStart(reader.name))
    _arguments(out, reader)
    return True


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


class HermesScanner:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the text, with
    whitespace inside the markers. Text that cannot become a call gives its `<tool_call>`
    back as text and scanning resumes right after it. A committed call whose JSON breaks
    ends there, and the rest up to `</tool_call>` is dropped; text other than the marker
    after a whole object ends the call and is scanned again as text."""

    def __init__(self, arguments_keys: tuple[str, ...] = ("arguments", "parameters")):
        self._keys = arguments_keys
        self._search = _MarkerSearch(HERMES_OPEN)
        self._body: str | None = None    # text after <tool_call>, None outside a call
        self._call: CallReader | None = None
        self._close = ""                 # the part of </tool_call> seen after the object
        self._dropping: _MarkerSearch | None = None
        """A broken committed call: its text up to </tool_call> is dropped."""

    def feed(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        while text:
            if self._dropping is not None:
                _, text = self._dropping.feed(text)
                if text is None:
                    break
                self._dropping = None
            elif self._body is None:
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
        self._dropping = None
        while self._body is not None:
            if self._call is not None and self._call.committed:
                self._body = None  # cut short, or its closing marker never came: the call stands
            else:
                out += self.feed(self._give_back(out))
        held, self._search.held = self._search.held, ""
        return out + ([held] if held else [])

    def _feed_call(self, text: str, out: list[Segment]) -> str:
        """Feeds `text` into the open call until it closes or fails; returns the text still
        to scan."""
        for i, c in enumerate(text):
            state = self._step(c, out)
            if state is True:
                continue
            self._body += text[:i + 1]
            committed = self._call is not None and self._call.committed
            if state is None:  # the closing marker
                self._body = None
                return text[i + 1:]
            if not committed:
                return self._give_back(out) + text[i + 1:]
            self._body = None
            if self._call.complete:  # text after a whole call: text again
                return self._close + text[i + 1:]
            self._dropping = _MarkerSearch(HERMES_CLOSE)
            return text[i:]
        self._body += text
        return ""

    def _step(self, c: str, out: list[Segment]) -> bool | None:
        """Advances the open call by one character: True while it goes on, None at the end
        of its closing marker, False when `c` cannot follow (self._close then holds the
        marker's part seen, `c` included)."""
        if self._call is None:
            if c.isspace():
                return True
            if c != "{":
                return False
            self._call = CallReader(self._keys)
        if not self._call.complete:
            return _read(out, self._call, c)
        if not self._close and c.isspace():
            return True
        self._close += c
        if not HERMES_CLOSE.startswith(self._close):
            return False
        return None if self._close == HERMES_CLOSE else True

    def _give_back(self, out: list[Segment]) -> str:
        """Not a call: its marker becomes text, and the text that followed the marker is
        returned to be scanned again."""
        body, self._body = self._body, None
        out.append(HERMES_OPEN)
        return body


class Llama3JsonScanner:
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}` at the start of the output
    or after `<|python_tag|>`, several separated by `;`. Text that cannot become a call is
    given back to be scanned as text (its `<|python_tag|>` included); a committed call whose
    JSON breaks ends there, and the rest is text; text after a call ends the run of calls,
    and a later `<|python_tag|>` starts another."""

    def __init__(self, arguments_keys: tuple[str, ...] = ("parameters", "arguments")):
        self._keys = arguments_keys
        self._search = _MarkerSearch(PYTHON_TAG)
        self._state = "start"      # start | text | calls | call | after_call
        self._held = ""            # the tag or `;` and whitespace before the next call
        self._call: CallReader | None = None

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
        while (self._state == "call" and not self._call.committed) or (
                self._state == "calls" and self._held.startswith(PYTHON_TAG)):
            unfinished = self._call.text if self._state == "call" else ""  # or a tag with no call after it
            again = self._give_back(out, unfinished)
            out += self.feed(again)
        held, self._search.held = self._search.held, ""
        self._state, self._held, self._call = "text", "", None  # a trailing `;` or whitespace is dropped
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
            self._call, self._state = CallReader(self._keys), "call"
        if self._state == "call":
            if not _read(out, self._call, c):
                if not self._call.committed:
                    return self._give_back(out, self._call.text + c)
                self._state, self._held, self._call = "text", "", None  # a broken call ends
                return c
            if self._call.complete:
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
