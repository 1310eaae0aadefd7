"""Reasoning content (engine/serving/reasoning.py): each family's split of a whole reply, and
the streamed split equal to the whole one for any split of the text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.engine.serving.reasoning import ReasoningSplitter, split_reasoning

CASES = [  # (text, starts inside, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "\nLet me see.\n", "Paris."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Paris.", False, None, "Paris."),
    ("  Paris <think>x</think>", False, None, "Paris <think>x</think>"),
    ("<think>cut short by max_tokens", False, "cut short by max_tokens", ""),
    ("<think></think>answer", False, None, "answer"),
    ("Let me see.</think>Paris.", True, "Let me see.", "Paris."),
    ("<think>again</think> ok", True, "again", "ok"),
    ("no end", True, "no end", ""),
    ("</think>", True, None, ""),
    ("a </thin", True, "a </thin", ""),
    ("<thi", False, None, "<thi"),
    ("", False, None, ""),
]


@pytest.mark.parametrize("text, inside, reasoning, content", CASES)
def test_whole_replies_split(text, inside, reasoning, content):
    assert split_reasoning(text, inside) == (reasoning, content)


CALL = "<tool_call>"
CALL_CASES = [  # (text, starts inside, reasoning, content) with tool calls read from the answer
    ("<think>I should call it. <tool_call>\n{}\n</tool_call>", False, "I should call it. ", "<tool_call>\n{}\n</tool_call>"),
    ("Look it up.<tool_call>{}</tool_call></think>done", True, "Look it up.", "<tool_call>{}</tool_call></think>done"),
    ("a</think> <tool_call>{}", True, "a", "<tool_call>{}"),
    ("<tool_call>{}", True, None, "<tool_call>{}"),
    ("a <tool_ca", True, "a <tool_ca", ""),
]


@pytest.mark.parametrize("text, inside, reasoning, content", CALL_CASES)
def test_a_tool_call_opened_inside_the_reasoning_ends_it(text, inside, reasoning, content):
    assert split_reasoning(text, inside, CALL) == (reasoning, content)


def test_without_tools_a_call_marker_is_reasoning():
    assert split_reasoning("x <tool_call>{}</think>y", True) == ("x <tool_call>{}", "y")


def streamed(text_pieces: list[str], inside: bool, call_open: str | None = None) -> tuple[str, str]:
    splitter, reasoning, content = ReasoningSplitter(inside, call_open), "", ""
    for piece in text_pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


texts = st.lists(st.sampled_from(["<think>", "</think>", "<thi", "</th", "nk>", " ", "\n", "a", "b c", "<", ">",
                                  "think", "é", CALL, "<tool"]), max_size=10).map("".join)


@settings(max_examples=300, deadline=None)
@given(texts, st.booleans(), st.sampled_from([None, CALL]), st.data())
def test_streamed_split_equals_the_whole_for_any_split(text, inside, call_open, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    reasoning, content = split_reasoning(text, inside, call_open)
    assert streamed(pieces, inside, call_open) == (reasoning or "", content)
    assert streamed(list(text), inside, call_open) == (reasoning or "", content)
