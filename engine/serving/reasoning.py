"""Reasoning content (vLLM's --reasoning-parser): what a reasoning model writes before its
answer, up to `</think>`, split off the reply as `reasoning_content`, whole and streamed.

Two families (server.reasoning_parser):
- `qwen3`: the reply reasons only if it opens with `<think>` (Qwen3's templates let the model
  open it; with `chat_template_kwargs: {"enable_thinking": false}` the template closes an
  empty block in the prompt and the reply is all answer);
- `deepseek_r1`: the reply starts inside the reasoning (DeepSeek-R1's template opens `<think>`
  in the prompt, as do those of Qwen3's thinking-only models; a `<think>` the model writes
  again is dropped).
Either way the reasoning ends at `</think>`, and a reply cut off before it is all reasoning.
The answer after it starts at its first character other than whitespace.

A tool call opened inside the reasoning (`<tool_call>`, which Qwen3.5-family models write
before closing `</think>`) ends it too: the call and what follows are the answer, read for
calls as any answer is, so no call is lost in the reasoning (vLLM #39056).

One splitter reads the whole reply and the stream alike, a character-exact state machine
whose decisions never depend on where the text was split (tests/unit/test_reasoning.py
checks any split), so both give the same reasoning and content."""

from __future__ import annotations

from .tools.scanners import marker_overlap

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = {"qwen3": False, "deepseek_r1": True}
"""Reasoning parser -> whether a reply starts inside its reasoning."""


class ReasoningSplitter:
    """Fed the reply's text in any pieces; each call returns the (reasoning, content) text it
    can release, holding back what may still be a marker."""

    def __init__(self, starts_inside: bool, call_open: str | None = None):
        """`call_open`: the marker that opens a tool call (the request's tool format's), which
        ends the reasoning and stays in the answer; None: only `</think>` ends it."""
        self._starts_inside = starts_inside
        self._ends = (THINK_CLOSE,) if call_open is None else (THINK_CLOSE, call_open)
        self._state = "start"   # start | reasoning | answer_start | answer
        self._held = ""
        self._fed = 0
        self.reasoning_chars = 0
        """Characters of the reply up to the end of its reasoning (its `</think>` included),
        once known: at that marker, or at finish() for a reply that never left it."""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        self._fed += len(text)
        text = self._held + text  # always the last len(text) characters fed
        self._held = ""
        while text:
            if self._state == "start":
                opened = text.lstrip()
                if opened.startswith(THINK_OPEN):
                    self._state, text = "reasoning", opened[len(THINK_OPEN):]
                elif THINK_OPEN.startswith(opened):  # perhaps the start of <think>: wait
                    self._held = text
                    break
                else:
                    self._state = "reasoning" if self._starts_inside else "answer_start"
            elif self._state == "reasoning":
                found = [(at, marker) for marker in self._ends if (at := text.find(marker)) >= 0]
                if found:
                    at, marker = min(found)
                    reasoning.append(text[:at])
                    self.reasoning_chars = self._fed - len(text) + at + (len(marker) if marker == THINK_CLOSE else 0)
                    if marker == THINK_CLOSE:
                        self._state, text = "answer_start", text[at + len(THINK_CLOSE):]
                    else:
                        self._state, text = "answer", text[at:]
                    continue
                keep = max(marker_overlap(text, marker) for marker in self._ends)
                reasoning.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            elif self._state == "answer_start":
                text = text.lstrip()
                if text:
                    self._state = "answer"
            else:
                content.append(text)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held, once the reply has ended."""
        held, self._held = self._held, ""
        if self._state == "reasoning" or (self._state == "start" and self._starts_inside):
            self.reasoning_chars = self._fed
            return held, ""
        return "", held.lstrip() if self._state in ("start", "answer_start") else held


def split_reasoning(text: str, starts_inside: bool, call_open: str | None = None) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply (`call_open` as ReasoningSplitter's)."""
    splitter = ReasoningSplitter(starts_inside, call_open)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2) or None, c1 + c2


def reasoning_tokens(text: str, token_ids: list[int], starts_inside: bool, call_open: str | None,
                     decode) -> int:
    """How many of a reply's tokens are its reasoning (usage's reasoning_tokens), its text
    split as ReasoningSplitter does (see tokens_through)."""
    splitter = ReasoningSplitter(starts_inside, call_open)
    splitter.feed(text)
    splitter.finish()
    return tokens_through(splitter.reasoning_chars, token_ids, decode)


def tokens_through(chars: int, token_ids: list[int], decode) -> int:
    """The fewest of `token_ids` whose text reaches `chars` characters (the one completing a
    reasoning's last character included), found by decoding prefixes (`decode`: ids -> text,
    as the reply was detokenized)."""
    if chars == 0:
        return 0
    low, high = 1, len(token_ids)
    while low < high:
        mid = (low + high) // 2
        if len(decode(token_ids[:mid])) >= chars:
            high = mid
        else:
            low = mid + 1
    return high
