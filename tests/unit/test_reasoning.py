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


def streamed(text_pieces: list[str], inside: bool) -> tuple[str, str]:
    splitter, reasoning, content = ReasoningSplitter(inside), "", ""
    for piece in text_pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


texts = st.lists(st.sampled_from(["<think>", "</think>", "<thi", "</th", "nk>", " ", "\n", "a", "b c", "<", ">",
                                  "think", "é"]), max_size=10).map("".join)


@settings(max_examples=300, deadline=None)
@given(texts, st.booleans(), st.data())
def test_streamed_split_equals_the_whole_for_any_split(text, inside, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    reasoning, content = split_reasoning(text, inside)
    assert streamed(pieces, inside) == (reasoning or "", content)
    assert streamed(list(text), inside) == (reasoning or "", content)
