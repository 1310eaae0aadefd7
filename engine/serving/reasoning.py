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

    def __init__(self, starts_inside: bool):
        self._starts_inside = starts_inside
        self._state = "start"   # start | reasoning | answer_start | answer
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        text = self._held + text
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
                at = text.find(THINK_CLOSE)
                if at >= 0:
                    reasoning.append(text[:at])
                    self._state, text = "answer_start", text[at + len(THINK_CLOSE):]
                    continue
                keep = marker_overlap(text, THINK_CLOSE)
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
            return held, ""
        return "", held.lstrip() if self._state in ("start", "answer_start") else held


def split_reasoning(text: str, starts_inside: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply."""
    splitter = ReasoningSplitter(starts_inside)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2) or None, c1 + c2
